"""The lease in a pool's SLURM jobs' comments (`skytasks:expires-at=<time>`), renewed while the
controller lives, so that `skytasks gc --slurm` tells a job nobody holds from a long run.

A pool with no `max_lifetime_minutes` asks for no `--time`: the partition's limit, perhaps none,
is all SLURM knows. A fixed expiry would then make gc cancel long runs, or no expiry make it miss
every orphan; a renewed one runs out `idle_minutes` and a little more after the controller is
gone (`remote_fields.lease_expiry`), as the batch script's own idle watch does. The job's owner
may change its comment (`scontrol update JobId=J Comment=...`), no operator needed.
"""

from __future__ import annotations

from datetime import datetime

from skytasks.errors import PoolStartError
from skytasks.providers.slurm import job as slurm_job
from skytasks.providers.slurm.shell import SlurmShell

# scontrol's words for a job that cannot hold a lease any more.
GONE = ("Invalid job id", "already finished")


def renew(shell: SlurmShell, job_ids: list[str], expires_at: datetime) -> list[str]:
    """Write the lease into each job's comment. Returns the jobs that are gone (not to be renewed
    again); raises PoolStartError, after trying every job, for one SLURM refused otherwise."""
    gone, refused = [], []
    comment = slurm_job.expiry_comment(expires_at)
    for job_id in job_ids:
        done = shell.run(["scontrol", "update", f"JobId={job_id}", f"Comment={comment}"], timeout=60)
        if done.returncode == 0:
            continue
        if any(word in done.stderr for word in GONE):
            gone.append(job_id)
        else:
            refused.append(f"job {job_id}: {slurm_job.slurm_message(done.stderr)}")
    if refused:
        raise PoolStartError(f"scontrol update Comment refused on {shell.where}: {'; '.join(refused)}")
    return gone
