"""Worker-free scheduling on this machine: serve the example training flow on a cron schedule.

    python deployments/serve.py              # nightly at 03:00 UTC
    python deployments/serve.py "*/10 * * * *"

Runs until stopped (Ctrl-C); trigger a run at once with
`prefect deployment run 'ddp-train/ddp-train-served'`, or in the UI with a custom run that picks a
saved GPU Pool.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flows.ddp_train import ddp_train  # noqa: E402

if __name__ == "__main__":
    cron = sys.argv[1] if len(sys.argv) > 1 else "0 3 * * *"
    # `pool`: a run from the UI picks a saved GPU Pool. Prefect's server would refuse the pick's
    # reference (a GPU Pool's fields all have defaults; see deployments/prefect.yaml): the flow
    # checks its parameters itself when it starts.
    ddp_train.serve(name="ddp-train-served", cron=cron, parameters={"epochs": 10, "nodes": 2}, tags=["skytasks"],
                    enforce_parameter_schema=False)
