"""`save_if_preempted` with objects: every rank saves the same step, then the attempt ends.

A notice reaches the ranks at slightly different times (one may be a step ahead), and a sharded
save is collective: so each call, the ranks agree whether any has a notice (one small all-reduce
on the default group, from the training loop's own thread, in its order). Once one has, all save
this step (unless it is the step just saved), wait for the commit within the notice's grace, and
end the attempt with `Preempted`.
"""

from __future__ import annotations

import time
from typing import Any


def _anyone_has_notice(mine: bool) -> bool:
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return mine
    group = dist.group.WORLD
    device_types = getattr(group, "_device_types", [torch.device("cpu")])
    on = torch.device("cpu") if torch.device("cpu") in device_types else torch.device("cuda", torch.cuda.current_device())
    flag = torch.tensor([int(mine)], dtype=torch.int32, device=on)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def save_sharded_if_preempted(ckpt: Any, state: Any, step: int) -> None:
    from skytasks.preemption import Preempted, preemption

    notice = preemption()
    if not _anyone_has_notice(notice is not None):
        return
    flight = ckpt._in_flight
    if flight is None or flight.step != step:
        ckpt.save(state, step)
    deadline = notice.deadline if notice is not None else None
    from skytasks.checkpointing.async_writer import wait_for_saves

    wait_for_saves(deadline)
    ckpt._in_flight = None
    said = notice.describe() if notice is not None else "a node of the pool is being preempted"
    since = f" {time.time() - notice.at:.2f}s after the notice" if notice is not None else ""
    raise Preempted(f"{said}; checkpoint of step {step} committed at {ckpt._layout.describe(step)}{since}; "
                    f"Checkpointer.restore(state) resumes from it")
