"""`skytasks check` for a slurm pool: SLURM's own answers, with nothing queued.

Where SLURM's commands run (here, or `slurm_login` over SSH: the start's own `SlurmShell`), that
its controller answers (`scontrol ping`), whether it would accept the pool's allocation (`sbatch
--test-only` with exactly the start's arguments: the provider's `_check_request`, naming the field
it refuses), and the partition's nodes as sinfo sees them: how many are idle, and whether enough
are up at all. Whether `remote_python` imports torch on the nodes needs an allocation: it is asked
as the pool starts, before any rank, and skipped here.
"""

from __future__ import annotations

import re
from typing import Iterator

from skytasks.errors import PoolConfigError, PoolStartError
from skytasks.pool_spec import PoolSpec
from skytasks.providers.checks import Check
from skytasks.event_bus import PoolReporter
from skytasks.providers.slurm import job as slurm_job
from skytasks.providers.slurm.shell import SlurmShell
from skytasks.providers.slurm.spec import SlurmSettings

# Node states (sinfo's %T, without its suffixes) with which a node can take no job.
UNUSABLE = ("down", "drain", "drained", "draining", "fail", "failing", "future", "inval", "unknown", "not_responding")


def run(spec: PoolSpec) -> Iterator[Check]:
    from skytasks.providers.slurm.provider import SlurmProvider

    provider = SlurmProvider(spec, PoolReporter(spec.name, "slurm"))
    shell = provider.shell
    try:
        answers = f"SLURM's controller answers on {shell.where}"
        try:
            done = shell.run(["scontrol", "ping"], timeout=30)
        except PoolStartError as exc:
            yield Check(answers, False, str(exc))
            return
        said = " ".join(done.stdout.split()) or slurm_job.slurm_message(done.stderr)
        if done.returncode != 0 or "DOWN" in done.stdout:
            yield Check(answers, False, said)
            return
        yield Check(answers, True, said)
        args = slurm_job.sbatch_args(spec, provider.pool_id, spec.nodes)
        accepts = f"SLURM would accept the allocation (sbatch --test-only {' '.join(_shown(args[1:]))})"
        try:
            yield Check(accepts, True, provider._check_request())
        except (PoolConfigError, PoolStartError) as exc:
            # Its arguments are in the check's name already.
            yield Check(accepts, False, re.sub(r" \(sbatch [^()]*\); nothing was queued$", "", str(exc)))
        yield _partition(shell, spec)
        yield Check("remote_python imports torch and cloudpickle on the nodes", None,
                    "needs an allocation: asked on each node as the pool starts, before any rank")
    finally:
        shell.close()


def _shown(args: list[str]) -> list[str]:
    """The arguments as a person reads them: not the job's own name and expiry (new every start)."""
    return [a for a in args if not a.startswith(("--job-name=", "--comment=", "--parsable", "--output="))]


def _partition(shell: SlurmShell, spec: PoolSpec) -> Check:
    part = spec.own(SlurmSettings).slurm_partition
    name = f"partition {part!r}" if part else "the default partition"
    want = f"{name} has {spec.fewest} node(s) that can run"
    done = shell.run(["sinfo", "-h", "-N", "-o", "%N|%T|%P", *([f"--partition={part}"] if part else [])], timeout=30)
    if done.returncode != 0:
        return Check(want, False, f"sinfo: {slurm_job.slurm_message(done.stderr)}")
    states: dict[str, str] = {}
    for line in done.stdout.splitlines():
        node, _, rest = line.strip().partition("|")
        state, _, partition = rest.partition("|")
        if node and (part or partition.endswith("*")):  # without a partition: SLURM's default one
            states[node] = state.strip().lower()
    if not states:
        return Check(want, False, f"sinfo lists no node in {name}")
    bare = {n: s.rstrip("*~#!%$@^-+") for n, s in states.items()}
    usable = [n for n, s in bare.items() if s not in UNUSABLE and not s.startswith(("down", "drain", "fail"))]
    idle = [n for n, s in bare.items() if s == "idle"]
    others = ", ".join(f"{n} {states[n]}" for n in sorted(states) if n not in idle)
    detail = f"{len(idle)} of {len(states)} idle" + (f" (the rest: {others})" if others else "")
    if len(usable) < spec.fewest:
        return Check(want, False, f"{detail}; only {len(usable)} can take a job")
    if len(idle) < spec.fewest:
        detail += "; the job would wait in the queue for the others"
    return Check(want, True, detail)
