"""`skytasks gc --slurm`: cancel skytasks jobs past their expiry.

Every allocation a pool submits is named `skytasks-<id>` and carries `skytasks:expires-at=<time>`
in its comment: a lease the pool renews while its controller lives (`slurm/lease.py`), so it runs
out `idle_minutes` and a little more after the controller is gone, or at `max_lifetime_minutes`
when the pool has a cap. A pool cancels its jobs on every path its controller lives through, and
an orphaned job ends itself after `idle_minutes` of silence (and at `--time`, or the partition's
limit, anyway); this sweep is the third line, for clusters where the batch job could not run its
own watch. A pool with no cap and a partition with no limit is thus still swept once orphaned.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Callable

from skytasks.providers.slurm import job as slurm_job
from skytasks.providers.slurm.shell import SlurmShell


def sweep_jobs(shell: SlurmShell, dry_run: bool = False, now: datetime | None = None,
               log: Callable[[str], None] = lambda line: None) -> list[str]:
    """Cancel (or with `dry_run`, only name) this user's skytasks jobs past their expiry."""
    now = now or datetime.now(timezone.utc)
    done = shell.run(["squeue", "-h", "--me", "-o", "%i|%j|%k"])
    expired = []
    for line in done.stdout.splitlines():
        job_id, _, rest = line.partition("|")
        name, _, comment = rest.partition("|")
        when = slurm_job.parse_expiry(comment)
        if name.startswith(slurm_job.JOB_PREFIX) and when is not None and when <= now:
            expired.append(job_id.strip())
            log(f"skytasks gc: {'would cancel' if dry_run else 'cancelling'} slurm job {job_id.strip()} ({name}, "
                f"expired {when:%Y-%m-%d %H:%M}Z)")
    if expired and not dry_run:
        shell.run(["scancel", *expired])
    return expired


def command(args: Any) -> int:
    """`skytasks gc --slurm`, where SLURM's commands work. `args`: the command line's (cli.py)."""
    import sys

    from skytasks.blocks.gpu_pool import GPUPool
    from skytasks.event_bus import PoolReporter
    from skytasks.providers.slurm.spec import SlurmSettings

    shell = SlurmShell(GPUPool(provider="slurm").spec().own(SlurmSettings), PoolReporter("gc", "slurm"))
    try:
        swept = sweep_jobs(shell, dry_run=args.dry_run, now=args.now, log=lambda line: print(line, file=sys.stderr))
    finally:
        shell.close()
    print(f"skytasks gc: {len(swept)} slurm job(s) {'to cancel' if args.dry_run else 'cancelled'}")
    return 0
