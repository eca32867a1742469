"""A flow served with `flow.serve`, for the cancellation test: its call never ends on its own."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prefect import flow  # noqa: E402

from skytasks import GPUPool, distributed_task  # noqa: E402


@distributed_task(pool=GPUPool(nodes=2))
def sleepy() -> None:
    time.sleep(3600)


@flow(name="sleepy-flow")
def sleepy_flow() -> None:
    sleepy()


if __name__ == "__main__":
    sleepy_flow.serve(name="cancel-me")
