"""A slow machine, made for real: a cgroup v1 `cpu` group with a CFS quota.

Every process put in the group, and every child it forks from then on, shares `fraction` of
one CPU: a slow node (an sshd, a slurmd, a kubelet's pods moved in), or a small machine under
load. Unlike busy loops beside the work, the quota slows only what is in the group: tests that
run beside it in another xdist worker keep the machine's cores.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


def available() -> bool:
    """Root, and a cgroup v1 cpu controller with CFS quotas."""
    return os.geteuid() == 0 and (CPU_CGROUP / "cpu.cfs_quota_us").exists()


def limit(group: Path, fraction: float | None) -> None:
    """Give `group` (an existing cpu cgroup) `fraction` of one CPU, or lift its limit (None)."""
    (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
    (group / "cpu.cfs_quota_us").write_text("-1" if fraction is None else str(max(1000, int(PERIOD_US * fraction))))


def join(group: Path, pid: int | str = 0) -> None:
    """Move `pid` (0: the calling process) into `group`. Safe between fork and exec
    (`preexec_fn`): a file written, nothing imported."""
    with open(group / "cgroup.procs", "w") as procs:
        procs.write(str(pid))


@contextlib.contextmanager
def slow_group(fraction: float, name: str = "slow") -> Iterator[Path]:
    """A new cpu cgroup limited to `fraction` of one CPU, for as long as the block lasts; what is
    still in it at the end goes back to the root group, and the group is removed."""
    group = CPU_CGROUP / f"skytasks-{name}-{uuid.uuid4().hex[:6]}"
    group.mkdir()
    try:
        limit(group, fraction)
        yield group
    finally:
        remove(group)


def remove(group: Path, within: float = 10.0) -> None:
    """Empty `group` and remove it. A process that was exiting as the group was emptied keeps it
    busy until its parent reaps it: the removal is tried again until `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        release(group)
        try:
            group.rmdir()
            return
        except OSError as busy:
            if busy.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
        time.sleep(0.1)


def release(group: Path) -> None:
    """Every process still in `group` back to the root cpu group (one that exited meanwhile is skipped)."""
    for pid in (group / "cgroup.procs").read_text().split():
        with contextlib.suppress(ProcessLookupError):
            join(CPU_CGROUP, pid)
