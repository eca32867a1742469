"""Saving and restoring the sharded form on every rank, in DCP's format, committed whole.

save: wait for the save in flight; the head removes what no commit finished and readies the step's
folder; a collective checks every rank saves the same step (and that no rank writes before the
folder is ready); DCP stages (async) or writes (sync); the commit runs in the background
(`async_writer`). restore: wait for the save in flight; the head picks the newest committed step
and tells every rank; each reads the metadata and values by `safe_metadata`'s rule and loads its
own shards, resharded to this world size, into the objects in place.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

from skytasks.checkpointing import async_writer, state as state_form
from skytasks.checkpointing.commit import MARKER
from skytasks.checkpointing.safe_metadata import safe_planner, safe_reader
from skytasks.errors import CheckpointError

_groups: dict[int, Any] = {}  # the default group's id -> this process's checkpoint group


def _distributed() -> bool:
    """A process group is up (a call's ranks always have one, a world of 1 too): DCP runs over it.
    Without one (a script's own process) DCP is told so, and its warning that it "assumes the
    intent is to save in a single process" is not passed on: that is the intent."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _quiet_without_a_group(dist_on: bool) -> None:
    """Each time a save or restore runs with no group: DCP's warning that it assumes a single
    process is not passed on, from any thread (an async save warns from DCP's own). Only that
    message of DCP's, by a filter (never `catch_warnings`, process-wide and unsafe while other
    threads warn), set again each time since a test runner or the user may reset the filters;
    filterwarnings drops the same filter before adding it, so they never pile up."""
    if not dist_on:
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                                category=UserWarning, module=r"torch\.distributed\.checkpoint")


def checkpoint_group() -> Any:
    """A gloo group of every rank, for checkpointing alone: DCP's and the commit's collectives run
    on a background thread, and must never interleave with the training's on the default group
    (gloo pairs collectives by their order). Made once, on the first save or restore, which every
    rank calls."""
    import torch.distributed as dist

    key = id(dist.group.WORLD)
    if key not in _groups:
        _groups[key] = dist.new_group(backend="gloo")
    return _groups[key]


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if _distributed() else 0


def _agree(values: list[int], group: Any) -> list[int]:
    """Each value's max over the ranks (min too, by negation): ranks that disagree are told."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values + [-v for v in values], dtype=torch.int64)
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    n = len(values)
    return [int(t[i]) for i in range(n)] + [-int(t[n + i]) for i in range(n)]


def save(ckpt: Any, state: Any, step: int) -> async_writer.SaveInFlight:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    started = time.monotonic()
    ckpt.wait()  # one save in flight: the next waits for it (and raises its failure)
    async_writer.wait_for_saves()  # any other Checkpointer's too: the checkpoint group is used by one at a time
    dist_on = _distributed()
    _quiet_without_a_group(dist_on)
    group = checkpoint_group() if dist_on else None
    rank, layout = _rank(), ckpt._layout
    failed = 0
    if rank == 0:
        try:
            for old in layout.uncommitted_steps():
                layout.remove(old)
            layout.prepare(step)
        except Exception as exc:  # noqa: BLE001 - told to every rank below, then raised everywhere
            failed, failure = 1, exc
    high_step, high_failed, low_step, _ = _agree([step, failed], group)
    if high_failed:
        if rank == 0:
            raise CheckpointError(f"Checkpointer.save: could not ready {layout.describe(step)}: {failure}") from failure
        raise CheckpointError(f"Checkpointer.save: the head could not ready {layout.describe(step)} (its error is "
                              f"rank 0's)")
    if high_step != low_step:
        raise CheckpointError(f"Checkpointer.save: the ranks save different steps ({low_step}..{high_step}); every "
                              f"rank calls save(state, step) with the same step")
    flat = state_form.to_dcp(state)
    local = layout.writing_folder(step)
    writer = FileSystemWriter(local)
    on_gpu = torch.cuda.is_available() and any(_on_cuda(v) for v in flat.values())
    if ckpt.async_save:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        # Staged here, before async_save returns: what the state becomes afterwards never
        # reaches this checkpoint. Pinned host memory on GPU, written by a separate process.
        stager = DefaultStager(StagingOptions(on_gpu, False, False, False))
        try:
            upload = dcp.async_save(
                flat, storage_writer=writer, process_group=group, async_stager=stager, no_dist=not dist_on,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS if on_gpu else AsyncCheckpointerType.THREAD)
        except BaseException:
            stager.close()
            raise
        upload.add_done_callback(lambda _: stager.close())
    else:
        from concurrent.futures import Future

        dcp.save(flat, storage_writer=writer, process_group=group, no_dist=not dist_on)
        upload = Future()
        upload.set_result(None)
    blocked = time.monotonic() - started
    where = layout.describe(step)
    world = _world()

    def commit() -> dict[str, Any]:
        return _commit(ckpt, upload, local, step, rank, world, group, started, blocked, where)

    return async_writer.start_commit(step, where, commit)


def _commit(ckpt: Any, upload: Any, local: str, step: int, rank: int, world: int, group: Any,
            started: float, blocked: float, where: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    layout = ckpt._layout
    error: BaseException | None = None
    nbytes = 0
    try:
        upload.result()  # DCP's writing (each rank's shards; the head's metadata last)
        nbytes = layout.publish(local, step, rank)
    except BaseException as exc:  # noqa: BLE001 - every rank hears of it below
        error = exc
    finally:
        layout.discard_writing_folder(local)
    parts = torch.tensor([int(error is not None), nbytes], dtype=torch.int64)
    if group is not None:
        dist.all_reduce(parts, group=group)  # every rank's part in place, and the checkpoint's bytes
    if error is not None:
        raise CheckpointError(f"the checkpoint of step {step} at {where} was not committed: this rank's part failed: "
                              f"{type(error).__name__}: {error}", "", where) from error
    if int(parts[0]):
        raise CheckpointError(f"the checkpoint of step {step} at {where} was not committed: {int(parts[0])} rank(s) "
                              f"could not write their part (their errors are theirs)", "", where)
    info = {"step": step, "world_size": world, "bytes": int(parts[1]), "path": where,
            "blocked_seconds": round(blocked, 4), "seconds": 0.0}
    marked = torch.tensor([0], dtype=torch.int64)
    if rank == 0:
        try:
            info["seconds"] = round(time.monotonic() - started, 4)
            if not ckpt.async_save:  # the loop waits for the whole of a synchronous save
                info["blocked_seconds"] = info["seconds"]
            layout.write_marker(step, info)  # last: from now on the checkpoint counts
            for old in layout.committed_steps()[:-ckpt.keep]:
                layout.remove(old)
        except BaseException as exc:  # noqa: BLE001 - told to every rank below
            error, marked[0] = exc, 1
    if group is not None:
        dist.broadcast(marked, src=0, group=group)
    if int(marked[0]):
        raise CheckpointError(f"the checkpoint of step {step} at {where} was not committed: the head could not write "
                              f"its {MARKER} marker: {error}", "", where)
    if rank == 0:
        from skytasks.checkpointing.committed_event import tell_the_call

        tell_the_call(info)
    return info


def restore(ckpt: Any, state: dict[str, Any]) -> int | None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from skytasks.checkpointing.torch_gate import check_torch_can_load_safely

    ckpt.wait()
    async_writer.wait_for_saves()  # another Checkpointer's save in flight may be of this same path
    layout = ckpt._layout
    check_torch_can_load_safely(ckpt.trusted, layout.where)
    dist_on = _distributed()
    _quiet_without_a_group(dist_on)
    group = checkpoint_group() if dist_on else None
    newest = torch.tensor([-1], dtype=torch.int64)
    if _rank() == 0:
        steps = layout.committed_steps()
        newest[0] = steps[-1] if steps else -1
    if group is not None:
        dist.broadcast(newest, src=0, group=group)  # the head's listing decides: every rank loads one step
    step = int(newest[0])
    if step < 0:
        return None
    local = layout.reading_folder(step)
    try:
        flat = state_form.to_dcp(state)
        reader = safe_reader(local, ckpt.trusted)
        try:
            dcp.load(flat, storage_reader=reader,
                     planner=safe_planner(ckpt.trusted, layout.describe(step)), process_group=group,
                     no_dist=not dist_on)
        except BaseException as exc:  # noqa: BLE001 - DCP's gathered failure, as the error it holds
            raise (reader.refused or plain_error(exc)) from None
    finally:
        layout.done_reading(local)
    state_form.from_dcp(state, flat)
    return step


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if _distributed() else 1


def _on_cuda(value: Any) -> bool:
    import torch

    if isinstance(value, torch.Tensor):
        return value.device.type == "cuda"
    if isinstance(value, dict):
        return any(_on_cuda(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_on_cuda(v) for v in value)
    return False


def plain_error(exc: BaseException) -> BaseException:
    """DCP gathers every rank's failure into one `CheckpointException` (a BaseException): the
    first of ours in it (a refused metadata file, a refused value) is raised as itself."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException):
        for _, (failure, _trace) in sorted(exc.failures.items()):
            if isinstance(failure, CheckpointError):
                return failure
        first = next(iter(exc.failures.values()), None)
        if first is not None:
            return CheckpointError(f"{type(first[0]).__name__}: {first[0]}")
    return exc
