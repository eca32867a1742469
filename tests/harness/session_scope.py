"""What one test session owns on a machine that runs several at once.

`make test` runs the suite in parallel sessions (pytest-xdist workers, and the Prefect floor tier
beside them). A leak check that looked at every skytasks process on the machine would blame one
session for another's live pool, so each session joins a cgroup of its own in the v1 `pids`
hierarchy: every process it starts, and every process those start (an sshd session, a slurmd's
job step, an orphan reparented to init), stays in it whoever its parent is now. The Kubernetes
test cluster's pods are the one exception (their kubelet moves them into the cluster's own cgroup
root, which names the session's pid: `skytasks-k8s-<pid>-`).

Where cgroups cannot be written (not root, no v1 `pids`), the session owns the whole machine, as
before: `mine()` is then true of every process.

The test clusters use fixed subnets, bridges and ports, so one session at a time may run each:
`exclusive("slurm")` waits for the lock, held until the session ends.
"""

from __future__ import annotations

import fcntl
import os
import sys
import time
from pathlib import Path

PIDS = Path("/sys/fs/cgroup/pids")
SESSIONS = PIDS / "skytasks-tests"
_own: str | None = None  # this session's cgroup path in the pids hierarchy ("/skytasks-tests/<pid>")
_held: dict[str, int] = {}


def pids_cgroup(pid: int | str = "self") -> str | None:
    """The pids-hierarchy cgroup of `pid`, or None if it has none (or is gone)."""
    return _cgroup_of("pids", pid)


def _cgroup_of(controller: str, pid: int | str = "self") -> str | None:
    try:
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controller in controllers.split(","):
                return path
    except OSError:
        return None
    return None


def join_own_cgroup() -> str | None:
    """Put this process (and so everything it starts from now on) in a pids cgroup of its own;
    its path, or None where that cannot be done. Sweeps the empty cgroups of ended sessions."""
    global _own
    if _own is not None:
        return _own
    try:
        SESSIONS.mkdir(exist_ok=True)
        sweep(keep_folder=True)  # another session may be starting beside this one
        mine = SESSIONS / str(os.getpid())
        mine.mkdir(parents=True, exist_ok=True)
        (mine / "cgroup.procs").write_text(str(os.getpid()))
    except OSError:
        return None
    _own = pids_cgroup()
    return _own


def leave_own_cgroup() -> None:
    """Back to the hierarchy's root, and remove the session's cgroup if nothing is left in it (a
    leaked process keeps it, to be seen)."""
    global _own
    if _own is None:
        return
    try:
        (PIDS / "cgroup.procs").write_text(str(os.getpid()))
        (SESSIONS / str(os.getpid())).rmdir()
    except OSError:
        pass
    _own = None


def sweep(wait: float = 0.0, keep_folder: bool = False) -> None:
    """Remove the cgroups of ended sessions once they are empty, waiting up to `wait` s for their
    last processes (a session's fork server leaves just after the session's process), and the
    sessions' folder if none is left. A session cannot remove its own while it runs: xdist's
    controller and `make test` sweep after theirs, and every session's start sweeps too."""
    deadline = time.monotonic() + wait
    try:
        folders = [f for f in SESSIONS.iterdir() if f.is_dir() and f.name.isdigit()]
    except OSError:
        return
    for folder in folders:
        if Path(f"/proc/{folder.name}").exists():
            continue  # a session still running
        try:
            while (folder / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
                time.sleep(0.2)
            folder.rmdir()  # only an empty one goes
        except OSError:
            pass
    if not keep_folder:
        try:
            SESSIONS.rmdir()  # only when no session's is left
        except OSError:
            pass


def mine(pid: int) -> bool:
    """This session started `pid` (or one of its processes did), or it is a pod of this session's
    Kubernetes cluster. True of every process where the session owns the machine."""
    if _own is None:
        return True
    path = pids_cgroup(pid)
    if path is None:
        return False
    return path == _own or path.startswith(_own + "/") or f"/skytasks-k8s-{os.getpid()}-" in path


def own_pids() -> set[int] | None:
    """Every process `mine()` is true of, read off the cgroups themselves (this session's, with
    the ones below it, and its Kubernetes cluster's pods): far cheaper than asking every process on
    the machine, as a leak check after each test would. None where the session owns the machine."""
    if _own is None:
        return None
    roots = [PIDS / _own.lstrip("/")]
    # A test cluster's cgroup root is made under the session's memory cgroup, in every hierarchy
    # (tests/harness/k8s/cluster.py): "<that path>/skytasks-k8s-<pid>-<tag>".
    for parent in {PIDS, PIDS / (_cgroup_of("memory") or "/").lstrip("/")}:
        try:
            roots += [d for d in parent.iterdir() if d.name.startswith(f"skytasks-k8s-{os.getpid()}-")]
        except OSError:
            pass
    found: set[int] = set()
    for root in roots:
        for folder, _, _ in os.walk(root):
            try:
                found.update(int(pid) for pid in Path(folder, "cgroup.procs").read_text().split())
            except OSError:
                pass  # removed meanwhile
    return found


def exclusive(resource: str) -> None:
    """Wait until no other session on this machine holds `resource`, then hold it until this
    process ends (the kernel drops the lock with it, however it ends)."""
    if resource in _held:
        return
    fd = os.open(f"/tmp/skytasks-tests-{resource}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        began = time.monotonic()
        print(f"waiting for the {resource} test cluster, held by another test session", file=sys.stderr)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print(f"got the {resource} test cluster after {time.monotonic() - began:.0f} s", file=sys.stderr)
    _held[resource] = fd


if __name__ == "__main__":  # `python -m tests.harness.session_scope`: `make test`'s sweep after its sessions
    sweep(wait=15)
