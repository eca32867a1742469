"""One pool's SLURM job, as text: the sbatch arguments, the batch script that holds the allocation,
and SLURM's answers read back (queue state, node addresses, which field an error is about).

Pure functions: nothing here runs a command, so every rule is tested without a cluster.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import datetime, timezone

from skytasks.pool_spec import PoolSpec
from skytasks.providers.remote_fields import lease_expiry
from skytasks.providers.slurm.spec import SlurmSettings

JOB_PREFIX = "skytasks-"
EXPIRES_KEY = "skytasks:expires-at="
TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def heartbeat_folders(job_id: str) -> str:
    """The start of the name of a job's heartbeat folders on each node's own /tmp (one per node,
    made by the agent's bootstrap with a random end, 0700: `node_steps.BOOTSTRAP`). The name is
    guessable and /tmp is everyone's, so nothing is taken on its name: a folder counts only when
    it is a real folder of this user's with mode 0700, where nobody else can put a file or a link.
    The batch script on the job's first node reads the `beat` file in each."""
    return f"/tmp/skytasks-slurm-{job_id}."


# The batch job's own process: it holds the allocation, and ends it when the controller has been
# silent for the idle limit (the agents touch the heartbeat whenever they hear the controller).
# `--time` (with max_lifetime_minutes; else the partition's limit) bounds it too. `sleep & wait`
# lets SLURM's SIGTERM end it at once. Only this user's 0700 folders are read (and removed at
# the end): another user on the node can neither end the allocation (an mtime of 1) nor keep it
# alive (a fresh file) with a folder or a file of theirs.
BATCH_SCRIPT = """#!/bin/bash
prefix=/tmp/skytasks-slurm-${SLURM_JOB_ID}.
me=$(id -u)
idle=%(idle)d
start=$(date +%%s)
own() { [ -d "$1" ] && [ ! -L "$1" ] && [ "$(stat -c %%u:%%a -- "$1" 2>/dev/null)" = "$me:700" ]; }
trap 'for d in "$prefix"*; do own "$d" && rm -rf -- "$d"; done' EXIT
while :; do
  now=$(date +%%s); last=$start
  for d in "$prefix"*; do
    own "$d" && [ -f "$d/beat" ] && [ ! -L "$d/beat" ] || continue
    m=$(stat -c %%Y -- "$d/beat" 2>/dev/null || echo 0)
    if [ "$m" = 1 ]; then
      echo "skytasks: nobody held the warm pool for its keep_warm_minutes; ending the allocation" >&2; exit 0
    fi
    [ "$m" -gt "$last" ] && last=$m
  done
  if [ $((now - last)) -ge "$idle" ]; then
    echo "skytasks: the controller was silent for $((now - last))s (idle limit ${idle}s); ending the allocation" >&2
    exit 0
  fi
  sleep %(every)g & wait $!
done
"""


def batch_script(idle_minutes: float) -> str:
    idle = max(2, round(idle_minutes * 60))
    return BATCH_SCRIPT % {"idle": idle, "every": min(30.0, max(1.0, idle / 4))}


def expiry_comment(expires_at: datetime) -> str:
    """The job's comment: its lease (`remote_fields.lease_expiry`), which the provider renews while
    the controller lives and `skytasks gc --slurm` reads."""
    return EXPIRES_KEY + expires_at.strftime(TIME_FORMAT)


def parse_expiry(comment: str) -> datetime | None:
    m = re.search(re.escape(EXPIRES_KEY) + r"(\S+)", comment or "")
    try:
        return datetime.strptime(m.group(1), TIME_FORMAT).replace(tzinfo=timezone.utc) if m else None
    except ValueError:
        return None


def notice_seconds(max_lifetime_minutes: float | None) -> int:
    """How long before the time limit SLURM sends the notice: two minutes, as EC2 gives a spot
    node, or a fifth of a short job's life. With no cap the partition's own limit (if any) ends the
    job, and the notice comes two minutes before it."""
    if max_lifetime_minutes is None:
        return 120
    return int(min(120, max(10, max_lifetime_minutes * 60 / 5)))


def time_limit(max_lifetime_minutes: float | None) -> list[str]:
    """`--time` in whole minutes; none without a cap: the partition's default (or its maximum)
    applies, and the batch script's idle watch still ends an allocation nobody holds."""
    if max_lifetime_minutes is None:
        return []
    return [f"--time={max(1, math.ceil(max_lifetime_minutes))}"]


def sbatch_args(spec: PoolSpec, pool_id: str, nodes: int, exclude: tuple[str, ...] = (),
                fewest: int | None = None, expires_at: datetime | None = None) -> list[str]:
    """The allocation for `nodes` nodes of this pool (SLURM's own `--nodes=MIN-MAX` when it may
    have `fewest`): one batch job for its whole life. `expires_at`: the pool's lease now (default:
    that of a pool starting now)."""
    s = spec.own(SlurmSettings)
    if expires_at is None:
        now = datetime.now(timezone.utc)
        expires_at = lease_expiry(now, now, s.idle_minutes, s.max_lifetime_minutes)
    count = f"{fewest}-{nodes}" if fewest is not None and fewest < nodes else str(nodes)
    args = ["sbatch", "--parsable", f"--job-name={pool_id}", f"--comment={expiry_comment(expires_at)}",
            f"--nodes={count}", f"--ntasks-per-node={spec.procs_per_node}",
            *time_limit(s.max_lifetime_minutes), "--output=/dev/null",
            # A failed node does not end the others' allocation: it is replaced on its own.
            "--no-kill", "--no-requeue",
            # The preemption notice: USR2 to every process of the job's steps (agents and ranks)
            # before the time limit (ours or the partition's), and at once on a preemption with
            # PreemptParameters=send_user_signal.
            f"--signal=USR2@{notice_seconds(s.max_lifetime_minutes)}"]
    for flag, value in (("--partition", s.slurm_partition), ("--account", s.slurm_account),
                        ("--qos", s.slurm_qos), ("--constraint", s.slurm_constraint), ("--gres", s.gres_for(spec))):
        if value:
            args.append(f"{flag}={value}")
    if exclude:
        args.append(f"--exclude={','.join(sorted(exclude))}")
    return args + list(s.slurm_extra_args)


@dataclass(frozen=True)
class QueueState:
    state: str  # PENDING, RUNNING, ... or "" when the job is no longer in the queue
    reason: str
    nodelist: str


def parse_queue_line(text: str) -> QueueState:
    line = next((ln for ln in text.splitlines() if ln.strip()), "")
    if not line:
        return QueueState("", "", "")
    state, _, rest = line.partition("|")
    reason, _, nodelist = rest.rpartition("|")
    return QueueState(state.strip(), reason.strip(), nodelist.strip())


def parse_nodes(scontrol_oneliners: str) -> dict[str, dict[str, str]]:
    """`scontrol -o show node ...` as {name: {key: value}}."""
    nodes: dict[str, dict[str, str]] = {}
    for line in scontrol_oneliners.splitlines():
        fields = dict((m[1], m[2]) for m in re.finditer(r"(\w+)=(\S*(?: (?!\w+=)\S+)*)", line))
        if "NodeName" in fields:
            nodes[fields["NodeName"]] = fields
    return nodes


# Pending reasons with which the job can never start: the field that asks for the impossible.
_NEVER_STARTS = (
    (re.compile(r"account", re.I), "slurm_account"),
    (re.compile(r"qos", re.I), "slurm_qos"),
    (re.compile(r"PartitionConfig|PartitionNodeLimit|node count", re.I), "nodes"),
    (re.compile(r"BadConstraints|constraint|feature", re.I), "slurm_constraint"),
)
_NEVER_STARTS_CODES = {"InvalidAccount", "AccountNotAllowed", "InvalidQOS", "QOSNotAllowed", "PartitionConfig",
                       "PartitionNodeLimit", "BadConstraints"}


def never_starts(reason: str) -> str | None:
    """The field to blame when a pending reason means the job can never start, else None."""
    if reason not in _NEVER_STARTS_CODES and "can't use this partition" not in reason:
        return None
    return next((f for pattern, f in _NEVER_STARTS if pattern.search(reason)), "slurm_partition")


# sbatch's own refusals, and the field that caused each.
_REFUSALS = (
    (re.compile(r"invalid partition", re.I), "slurm_partition"),
    (re.compile(r"invalid account|account/partition", re.I), "slurm_account"),
    (re.compile(r"invalid qos|qos", re.I), "slurm_qos"),
    (re.compile(r"invalid generic resource|gres", re.I), "slurm_gres"),
    (re.compile(r"invalid feature|constraint", re.I), "slurm_constraint"),
    (re.compile(r"node count|Node count specification", re.I), "nodes"),
    (re.compile(r"time limit", re.I), "max_lifetime_minutes"),
)


def refused_field(message: str) -> str | None:
    """Which field an sbatch refusal is about, when its message says; None when it does not
    (then the caller narrows it down by asking again without each optional request)."""
    return next((f for pattern, f in _REFUSALS if pattern.search(message)), None)


def slurm_message(stderr: str) -> str:
    """SLURM's own words, one line: "sbatch: error: X" and "allocation failure: X" as X."""
    lines = [re.sub(r"^(sbatch|srun|salloc): (error: )?|^allocation failure: ", "", ln.strip())
             for ln in stderr.splitlines() if ln.strip()]
    return "; ".join(dict.fromkeys(lines)) or "no message"
