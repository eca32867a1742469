"""A controller that brings a pool up and runs a call that never ends, for stop-from-outside tests.

It prints READY once every rank is inside the function, then blocks.
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from skytasks import GPUPool  # noqa: E402
from skytasks import distributed_task, rank_info  # noqa: E402

MARKER_DIR = Path(sys.argv[1])


@distributed_task
def forever() -> None:
    (MARKER_DIR / f"rank{rank_info().rank}.pid").write_text(str(os.getpid()))
    time.sleep(3600)


if __name__ == "__main__":
    with GPUPool(nodes=2, procs_per_node=1):
        try:
            forever()
        finally:
            print("TEARDOWN", flush=True)
