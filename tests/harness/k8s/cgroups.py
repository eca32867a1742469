"""The cgroups the kubelets run in: the v1 hierarchies, and removing what a cluster made."""

from __future__ import annotations

import os
import time
from pathlib import Path


def _v1_hierarchies(unified: bool = False) -> list[Path]:
    """The mount points of the cgroup v1 hierarchies (and of the v2 one beside them, where runc
    makes the containers' cgroups too)."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        if right.split()[:1] == ["cgroup"] or (unified and right.split()[:1] == ["cgroup2"]):
            found.append(Path(left.split()[4]))
    return found


def _own_memory_cgroup() -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return path.rstrip("/")
    return ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_cgroup_tree(path: Path, timeout: float = 10.0) -> bool:
    """rmdir a cgroup and every cgroup below it, deepest first (a cgroup folder holds no files
    that rmdir minds). Retries while killed processes are still leaving it."""
    deadline = time.monotonic() + timeout
    while True:
        if not path.exists():
            return True
        dirs = sorted((Path(d) for d, _, _ in os.walk(path)), key=lambda p: len(p.parts), reverse=True)
        busy = False
        for d in dirs:
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                busy = True
        if not busy and not path.exists():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def _remove_cgroups(made: list[str], timeout: float = 10.0) -> None:
    """The cgroups a cluster made (listed in the order made), with all the kubelet and runc made
    below them: the cluster's own root with everything in it (waiting while killed processes
    leave), then the folders above it it had to make, if no other cluster uses them now."""
    for d in reversed(made):
        path = Path(d)
        if path.name.startswith("skytasks-k8s-"):
            _remove_cgroup_tree(path, timeout)
        else:
            try:
                path.rmdir()
            except OSError:
                pass
