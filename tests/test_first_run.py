"""A first run on a small machine just works: the README's first example, run as written on a
fresh HOME (Prefect's ephemeral server creates its database first) on a small, loaded machine,
with nothing exported. The machine is the run's own: a cpu cgroup giving it and everything it
starts SMALL_MACHINE_CPUS of one CPU, what six busy loops beside it left it on the 2-core dev
machine, without taking the cores from tests running beside this one. (Measured 2026-11-28 with
the busy loops: with Prefect's own 20 s limit this run failed with "Timed out while attempting to
connect to ephemeral Prefect API server" after 46 s; with skytasks' limit it passed in 65 s. With
the cgroup: 45 s and a time-out, and 56 s and a pass.) And the limit skytasks raises for that is
the user's when they set one, wherever Prefect reads it from.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from tests.harness import slow_cpu
from tests.test_readme import README, first_python_block

SMALL_MACHINE_CPUS = 0.6

READ_LIMIT = """\
import sys
first = sys.argv[1]
if first == "prefect":
    import prefect.flows  # Prefect reads its settings before skytasks is imported
import skytasks
from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS as LIMIT
print(LIMIT.value())
"""


def _clean_env(home) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.pop("PYTHONPATH", None)  # the installed package only, as on a user's machine
    env.update(HOME=str(home))
    return env


def _limit(tmp_path, first: str, **extra: str) -> int:
    (tmp_path / "read_limit.py").write_text(READ_LIMIT)
    env = {**_clean_env(tmp_path / "home"), **extra}
    done = subprocess.run([sys.executable, "read_limit.py", first], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1])


def test_the_servers_limit_is_raised_unless_the_user_set_one(tmp_path):
    from skytasks.ephemeral_timeout import FIRST_START_SECONDS

    (tmp_path / "home").mkdir()
    assert FIRST_START_SECONDS > 20
    assert _limit(tmp_path, "skytasks") == FIRST_START_SECONDS
    assert _limit(tmp_path, "prefect") == FIRST_START_SECONDS  # Prefect had read its settings already
    assert _limit(tmp_path, "prefect", PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="33") == 33
    profiles = tmp_path / "home" / ".prefect" / "profiles.toml"
    profiles.parent.mkdir(exist_ok=True)
    profiles.write_text('active = "mine"\n[profiles.mine]\nPREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS = "44"\n')
    assert _limit(tmp_path, "prefect") == 44
    assert _limit(tmp_path, "skytasks") == 44
    profiles.unlink()
    (tmp_path / "prefect.toml").write_text("[server.ephemeral]\nstartup_timeout_seconds = 55\n")
    assert _limit(tmp_path, "skytasks") == 55


def test_a_first_run_of_the_readme_example_on_a_fresh_home_passes_on_a_loaded_machine(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    (work / "regression.py").write_text(first_python_block(README.read_text()))
    if not slow_cpu.available():
        pytest.skip("a cgroup v1 cpu controller (and root) is needed to make a small machine")
    with slow_cpu.slow_group(SMALL_MACHINE_CPUS, "small-machine") as group:
        done = subprocess.run([sys.executable, "regression.py"], cwd=work, env=_clean_env(home), capture_output=True,
                              text=True, timeout=480, preexec_fn=lambda: slow_cpu.join(group))
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "Timed out while attempting to connect" not in out
    assert (home / ".prefect" / "prefect.db").exists()  # Prefect's own server made its database on this first run
    results = [ast.literal_eval(line) for line in done.stdout.splitlines() if line.startswith("{'rank'")]
    assert [r["rank"] for r in results] == [0, 1], out[-4000:]
