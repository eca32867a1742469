"""A torchrun script is forked from its rank, which has the node's torch already, and is what a
fresh `python SCRIPT` would be (skytasks/node/script_fork.py). Each test runs the same script
twice: as it is (forked), and with a comment naming OMP_NUM_THREADS, which makes it start cold,
a fresh interpreter, as before. What the script sees must not differ, but for torch being there."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from skytasks import GPUPool, run_script
from skytasks.errors import DistributedTaskError, ScriptFailed

# What a script can see of its process, before and after its own torch group.
PROBE = """
dunders = {k: type(v).__name__ for k, v in dict(globals()).items()}  # __main__'s globals, as the script begins
import sys
had_torch = "torch" in sys.modules  # forked: the node's template imported it already
import atexit, json, logging, os, signal, threading
import torch
import torch.distributed as dist
fds_at_start = sorted(os.listdir("/proc/self/fd"))
dist.init_process_group("gloo")
t = torch.tensor([1.0]); dist.all_reduce(t)
seen = {
    "had_torch": had_torch, "dunders": dunders, "argv": sys.argv, "name": __name__, "file": __file__, "path": sys.path,
    "cwd": os.getcwd(), "env": dict(os.environ), "fds_at_start": fds_at_start, "stdin": sys.stdin.read(),
    "signals": {s.name: str(signal.getsignal(s)) for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)
                and isinstance(s, signal.Signals)},
    "root_handlers": len(logging.getLogger().handlers), "threads": torch.get_num_threads(), "sum": t.item(),
    "main": sys.modules["__main__"].__file__, "same_group": os.getpgid(0) == os.getpgid(os.getppid()),
}
out, rank = sys.argv[1], dist.get_rank()
with open(os.path.join(out, f"{rank}.json"), "w") as f:
    json.dump(seen, f)
atexit.register(lambda: open(os.path.join(out, f"{rank}.atexit"), "w").close())
def late():
    import time; time.sleep(0.2); open(os.path.join(out, f"{rank}.joined"), "w").close()
threading.Thread(target=late).start()  # not a daemon: the interpreter waits for it as it ends
dist.destroy_process_group()
"""

COLD = "# OMP_NUM_THREADS: named here, so this script starts as a fresh interpreter\n"


def two_ways(tmp_path: Path, text: str) -> tuple[Path, Path]:
    project = tmp_path / "project"
    project.mkdir()
    (project / "forked.py").write_text(text)
    (project / "cold.py").write_text(COLD + text)
    return project / "forked.py", project / "cold.py"


def seen(out: Path) -> dict[int, dict]:
    return {int(p.stem): json.loads(p.read_text()) for p in out.glob("*.json")}


def test_a_forked_script_sees_what_a_fresh_interpreter_sees_but_torch_already_there(tmp_path):
    forked, cold = two_ways(tmp_path, PROBE)
    pool = GPUPool(nodes=2, procs_per_node=2)
    runs = {}
    for script in (forked, cold):
        out = tmp_path / script.stem
        out.mkdir()
        run_script(script.name, [str(out)], workdir=script.parent, pool=pool)
        runs[script.stem] = seen(out)
        assert sorted(runs[script.stem]) == [0, 1, 2, 3]
        assert len(list(out.glob("*.atexit"))) == 4 and len(list(out.glob("*.joined"))) == 4
    for rank in range(4):
        mine, fresh = runs["forked"][rank], runs["cold"][rank]
        assert mine["had_torch"] and not fresh["had_torch"]  # the one difference, and why it is faster
        assert mine["argv"] == ["forked.py", str(tmp_path / "forked")] and fresh["argv"][0] == "cold.py"
        assert mine["name"] == "__main__" and mine["file"] == mine["main"] == str(forked)
        assert mine["dunders"] == fresh["dunders"] and mine["dunders"]["__builtins__"] == "module"
        assert mine["path"] == fresh["path"] and mine["path"][0] == str(forked.parent)
        assert mine["cwd"] == fresh["cwd"] == str(forked.parent)
        differ = {"TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "MASTER_PORT", "SKYTASKS_GROUP",
                  "SKYTASKS_STACK_FILE"}  # per call, by nature
        assert {k: v for k, v in mine["env"].items() if k not in differ} == \
            {k: v for k, v in fresh["env"].items() if k not in differ}
        assert mine["env"]["OMP_NUM_THREADS"] == "1" and mine["threads"] == fresh["threads"] == 1  # torchrun's default
        assert mine["fds_at_start"] == fresh["fds_at_start"] == ["0", "1", "2", "3"]  # 3: listdir's own
        assert mine["stdin"] == "" and mine["root_handlers"] == fresh["root_handlers"] == 0
        assert mine["signals"] == fresh["signals"]
        assert mine["signals"]["SIGPIPE"] == str(signal.SIG_IGN) and mine["signals"]["SIGTERM"] == str(signal.SIG_DFL)
        assert mine["same_group"] and mine["sum"] == 4.0


FAILS = """
import sys
import torch
def deep():
    raise ValueError("the script's own error")
if sys.argv[1] == "raise":
    deep()
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("how", ["raise", "5"])
def test_a_forked_script_ends_as_a_fresh_one_exit_code_and_traceback_alike(tmp_path, how):
    forked, cold = two_ways(tmp_path, FAILS)
    failures = {}
    for script in (forked, cold):
        with pytest.raises(DistributedTaskError) as caught:
            run_script(script.name, [how], workdir=script.parent, pool=GPUPool(nodes=1))
        (failures[script.stem],) = caught.value.exceptions
    mine, fresh = failures["forked"], failures["cold"]
    assert isinstance(mine, ScriptFailed) and mine.exit_code == fresh.exit_code == (1 if how == "raise" else 5)
    if how == "raise":
        # The script's frames only, as a fresh interpreter prints them (the line numbers differ by the comment).
        assert mine.stderr_tail.splitlines()[0] == fresh.stderr_tail.splitlines()[0] == "Traceback (most recent call last):"
        assert [line.split(", line")[0] for line in mine.stderr_tail.replace("forked.py", "X").splitlines()] == \
            [line.split(", line")[0] for line in fresh.stderr_tail.replace("cold.py", "X").splitlines()]
        assert "skytasks" not in mine.stderr_tail and "ValueError: the script's own error" in mine.stderr_tail


SETS_THREADS = """
import json, os, sys
had = "torch" in sys.modules
os.environ["OMP_NUM_THREADS"] = "2"  # before its own import of torch: it must get a fresh one
import torch
print(json.dumps({"had": had, "threads": torch.get_num_threads()}))
"""


def test_a_script_that_sets_torchs_threads_itself_starts_fresh_and_gets_them(tmp_path, capsys):
    (tmp_path / "threads.py").write_text(SETS_THREADS)
    run_script("threads.py", workdir=tmp_path, pool=GPUPool(nodes=1, procs_per_node=2))
    lines = [json.loads(line.split("] ", 1)[1]) for line in capsys.readouterr().out.splitlines() if '"threads"' in line]
    # Forked, it would have had torchrun's 1 for two ranks a node (torch caps it at the cores: 2 here).
    assert [(line["had"], line["threads"]) for line in lines] == [(False, 2), (False, 2)]


def test_a_module_of_the_scripts_folder_named_as_one_the_rank_has_is_the_folders(tmp_path, capsys):
    (tmp_path / "cloudpickle.py").write_text("WHOSE = 'the folder'\n")  # the rank imported the real one
    (tmp_path / "uses.py").write_text("import cloudpickle\nprint('whose:', cloudpickle.WHOSE)\n")
    run_script("uses.py", workdir=tmp_path, pool=GPUPool(nodes=1))
    assert "whose: the folder" in capsys.readouterr().out
