"""Which tests share a pytest-xdist worker (`make test` runs `pytest -n N --dist loadgroup`).

- every test on the SLURM test cluster runs in one worker, and every test on the Kubernetes test
  cluster in one worker: each cluster is started once, and its fixed subnets and ports allow only
  one (`session_scope.exclusive` makes any other session wait for it);
- otherwise a module's tests run together, so its module-scoped servers and pools start once.

A test's group needs its fixtures (a test may reach a cluster through a fixture of its module),
which only a worker's collection knows, while xdist's controller schedules by test id alone. (xdist
3.8's own `xdist_group` marks work by renaming a test's id, which pytest 9.2 no longer reads.) So each
worker writes the groups it collected to a file the controller names in SKYTASKS_TEST_GROUPS, and
the controller's scheduler reads it: `GroupScheduling`.

Groups are handed out longest first, by the seconds their modules took in a clean-clone run
(`group_seconds.json`, module: [seconds, tests]; a module not in it counts 2 s a test): a long
group handed out last leaves the other workers idle while it runs. Only the order depends on it:
a stale figure costs time, never a test.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

ENV = "SKYTASKS_TEST_GROUPS"
SECONDS_FILE = Path(__file__).with_name("group_seconds.json")
UNKNOWN_TEST_SECONDS = 2.0
SLURM_FIXTURES = {"cluster", "login_node", "slurm_queue_empty_after"}
K8S_FIXTURES = {"k8s", "k8s_cluster"}


def group_of(item) -> str:
    words = item.nodeid.lower()
    names = set(getattr(item, "fixturenames", ()))
    if names & K8S_FIXTURES or "kubernetes" in words or "k8s" in words:
        return "k8s"
    if names & SLURM_FIXTURES or "slurm" in words:
        return "slurm"
    return item.nodeid.split("::", 1)[0]


def name_the_file() -> None:
    """In the controller, before its workers start (they inherit the environment)."""
    os.environ[ENV] = f"/tmp/skytasks-test-groups-{os.getpid()}.json"


def longest_first(items: list) -> None:
    """Reorder `items` in place: each group's tests together, in their order, the groups by their
    seconds, the longest first. Every worker collects the same tests and orders them alike."""
    try:
        seconds = {m: s / max(1, n) for m, (s, n) in json.loads(SECONDS_FILE.read_text()).items()}
    except (OSError, ValueError):
        return
    groups = {id(item): group_of(item) for item in items}
    cost: dict[str, float] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        cost[groups[id(item)]] = cost.get(groups[id(item)], 0.0) + seconds.get(module, UNKNOWN_TEST_SECONDS)
    first_seen = {}
    for index, item in enumerate(items):
        first_seen.setdefault(groups[id(item)], index)
    items.sort(key=lambda item: (-cost[groups[id(item)]], first_seen[groups[id(item)]]))


def write_groups(items) -> None:
    """In a worker, once collected: every worker collects the same tests, and writes them whole
    (a rename: the controller never reads half a file)."""
    path = os.environ.get(ENV)
    if not path:
        return
    partial = f"{path}.{os.environ.get('PYTEST_XDIST_WORKER', os.getpid())}"
    Path(partial).write_text(json.dumps({item.nodeid: group_of(item) for item in items}))
    os.replace(partial, path)


def remove_the_file() -> None:
    path = os.environ.get(ENV)
    if path:
        Path(path).unlink(missing_ok=True)


def scheduler(config, log):
    """xdist's scope scheduling with `group_of`'s groups as the scopes, handed out in the order of
    the workers' collection (`longest_first`), the clusters' among the first. (xdist is imported
    here: the Prefect floor tier's environment runs without it.)"""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        _groups: dict[str, str] | None = None

        def __init__(self, config, log=None):
            super().__init__(config, log)
            config.option.loadscopereorder = False  # the workers' collection is in the order wanted (longest_first)

        def _split_scope(self, nodeid: str) -> str:
            if self._groups is None:
                path = os.environ.get(ENV)
                self._groups = json.loads(Path(path).read_text()) if path and Path(path).exists() else {}
            return self._groups.get(nodeid) or nodeid.split("::", 1)[0]

    return GroupScheduling(config, log)


def seconds_from_junit(path: str) -> None:
    """Write `group_seconds.json` from a run's `--junitxml` file: each module's seconds and tests."""
    import xml.etree.ElementTree as ET

    seconds: dict[str, list] = {}
    for case in ET.parse(path).iter("testcase"):
        module = case.get("classname", "").replace(".", "/") + ".py"
        entry = seconds.setdefault(module, [0.0, 0])
        entry[0] += float(case.get("time") or 0)
        entry[1] += 1
    lines = [f'  "{m}": [{round(s, 1)}, {n}]' for m, (s, n) in sorted(seconds.items())]
    SECONDS_FILE.write_text("{\n" + ",\n".join(lines) + "\n}\n")


if __name__ == "__main__":  # python -m tests.harness.xdist_groups RUN.xml
    import sys

    seconds_from_junit(sys.argv[1])
