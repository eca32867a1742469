"""A user's script: functions from __main__, from an imported module, and from `exec` and a
notebook-like cell, each failing on a rank. Prints each remote traceback, then the cloudpickle
version in use, for tests/test_user_frames.py."""

import linecache
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cloudpickle  # noqa: E402

from skytasks import DistributedTaskError, GPUPool, distributed_task  # noqa: E402
from user_frames_helper import helper_fails  # noqa: E402


def main_fails() -> None:
    numbers = [1, 2]
    return numbers[5]  # the line a person wants to see


CELL = "def cell_fails():\n    x = {}\n    return x['missing']  # from a cell\n"
CELL_FILE = "/tmp/ipykernel_4242/3153214815.py"  # where IPython 8 puts a cell's code


def from_cell():
    # What IPython does with a cell (compilerop.CachingCompiler.cache): the file name is made
    # up and the source lives only in linecache.
    lines = CELL.splitlines(keepends=True)
    linecache.cache[CELL_FILE] = (len(CELL), None, lines, CELL_FILE)
    namespace = {"__name__": "__main__"}
    exec(compile(CELL, CELL_FILE, "exec"), namespace)
    return namespace["cell_fails"]


def from_exec():
    namespace = {"__name__": "__main__"}
    exec("def exec_fails():\n    return 1 / 0\n", namespace)
    return namespace["exec_fails"]


if __name__ == "__main__":
    with GPUPool(nodes=2, procs_per_node=1):
        for fn in (main_fails, helper_fails, from_cell(), from_exec()):
            try:
                distributed_task(fn, init_torch=False)()
            except DistributedTaskError as err:
                print(f"=== {fn.__name__}")
                print(err.exceptions[0].__cause__.tb)
    print(f"cloudpickle {cloudpickle.__version__}")
