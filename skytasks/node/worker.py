"""A rank process: initialise torch.distributed once, then run the calls it is sent.

It is started by a node agent with its rank environment already set. It reads frames from the
agent on stdin and writes frames to the agent on the socket named by SKYTASKS_CTRL_FD (which
brings it preemption notices the other way); its own
stdout and stderr are the user's output, relayed line by line. Inside a warm pool it serves
many calls with one process group; a failed call is never followed by another in the same
process (the controller discards the group).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

from skytasks import preemption
from skytasks.node import socket_interface
from skytasks.node.linux import PR_SET_PDEATHSIG, prctl
from skytasks.node.control_channel import HandedFiles, serve_control_channel
from skytasks import flight_recorder
from skytasks.node.rank_channel import RankStream, RankWriter, ShipLogRecords
from skytasks.rank import ENV_ATTEMPT, ENV_PEERS
from skytasks.serialization import dumps_out_of_band, loads_out_of_band, mapped_buffer, release, shared_buffer
from skytasks.protocol import Op, message
from skytasks.wire import TO_AGENT, BlobRef, ChannelClosed, FrameWriter, read_frame

# What a rank imports as it starts beyond this module's own imports (its stack dumps, main): a
# node's warm template imports them once, so each forked rank does not (about 4 ms of CPU each).
STARTUP_MODULES = ("faulthandler", "skytasks.metrics")


def _die_with_parent() -> None:
    """If the agent dies, even by SIGKILL, the kernel kills this rank too (Linux)."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the agent died before prctl took effect
        os._exit(1)


def _describe_exception(exc: BaseException) -> dict[str, Any]:
    import cloudpickle

    described: dict[str, Any] = {
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
        "exception": None,
    }
    try:
        described["exception"] = cloudpickle.dumps(exc)
    except Exception:  # noqa: BLE001 - the controller builds a stand-in from the strings
        pass
    return described


def _init_process_group(out: FrameWriter) -> None:
    # nccl: a failed or stuck collective raises instead of hanging the rank forever. Set before
    # torch reads it, whatever the backend, so code that makes its own nccl groups gets it too.
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    import torch
    import torch.distributed as dist

    # The controller chose both from what each node reported (skytasks.devices); a rank never
    # guesses, so two ranks on one GPU never reach NCCL.
    backend = os.environ.get("SKYTASKS_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    device = os.environ.get("SKYTASKS_DEVICE", "cpu")
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.set_device(torch.device(device))  # torch.cuda.current_device() is this rank's GPU
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # Only the rendezvous is bounded by the init timeout (the controller's clock fires first and
    # names the missing ranks); collectives keep torch's own default timeout, since a long
    # checkpoint on the head must not break a barrier. Fail-fast never waits on either.
    init_timeout = float(os.environ["SKYTASKS_INIT_TIMEOUT_SECONDS"]) + 10  # set by the controller, always
    out.send(message(Op.JOINING))
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if rank != 0 and os.environ.get("SKYTASKS_PREFLIGHT"):  # a node that cannot reach the head is named, not waited for
        from skytasks.node.head_reach import reach_head

        reach_head(addr, port, float(os.environ["SKYTASKS_PREFLIGHT"]))
    listen_fd = None
    if rank == 0:
        # Bound here, to the peers' interface: torch's own bind is the wildcard, and whoever
        # reaches the store can run code in the ranks. torch owns the descriptor from now on
        # (detach: closed once, by the store); a failure here ends this rank anyway.
        listen_fd = socket_interface.peer_listener(addr, port, store_peers()).detach()
    store = dist.TCPStore(
        addr, port, world, is_master=rank == 0,
        timeout=timedelta(seconds=init_timeout), wait_for_workers=True, master_listen_fd=listen_fd,
    )
    if backend == "nccl":
        # A CPU backend beside NCCL: CPU collectives (async checkpointing's, a user's) work too.
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world)


def store_peers() -> list[str]:
    """The addresses of the group's nodes (SKYTASKS_PEERS), which the head's store must be reachable from."""
    return list(json.loads(os.environ.get(ENV_PEERS, "[]")))


_BLOBS: dict[str, Any] = {}  # this call's large arguments, kept for the next call


def _unpack(msg: dict[str, Any]) -> tuple[Any, tuple, dict]:
    import cloudpickle

    refs = msg["refs"]
    for key in set(_BLOBS) - set(refs):  # the controller keeps exactly this call's blobs too
        release(_BLOBS.pop(key))
    _BLOBS.update(msg["blobs"])
    fn, args, kwargs = cloudpickle.loads(msg["head"])

    def resolve(value: Any) -> Any:
        # A copy each call: the function may change its argument in place, the cache must not.
        return loads_out_of_band(_BLOBS[refs[value.slot]], copy=True) if isinstance(value, BlobRef) else value

    return fn, tuple(resolve(a) for a in args), {k: resolve(v) for k, v in kwargs.items()}


def _usage_now() -> tuple[Any, Any]:
    return resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)


def _cpu_seconds(usage: tuple[Any, Any]) -> float:
    return sum(u.ru_utime + u.ru_stime for u in usage)


def _used(before: tuple[Any, Any]) -> dict[str, float]:
    """Peak RSS (this process or its largest waited-for child, a script's) and CPU seconds of the call."""
    after = _usage_now()
    return {"peak_rss": float(max(u.ru_maxrss for u in after) * 1024),
            "cpu_seconds": _cpu_seconds(after) - _cpu_seconds(before)}


def _run_call(msg: dict[str, Any], out: FrameWriter) -> bool:
    rank = int(os.environ["RANK"])
    os.environ[ENV_ATTEMPT] = str(msg["attempt"])
    started, usage_before = time.time(), _usage_now()
    try:
        fn, args, kwargs = _unpack(msg)
        try:
            value = fn(*args, **kwargs)
        except BaseException as raised:
            _finish_checkpoints(raised)
            raise
        _finish_checkpoints(None)
    except BaseException as exc:  # noqa: BLE001 - everything, KeyboardInterrupt included, goes back
        out.send(message(Op.FAILED, call=msg["call"], started=started, ended=time.time(), used=_used(usage_before),
                         **_describe_exception(exc)))
        return False
    try:
        blob = dumps_out_of_band(value)
    except Exception as exc:  # noqa: BLE001
        err = TypeError(
            f"rank {rank} returned a value of type {type(value).__module__}.{type(value).__qualname__} "
            f"that cannot be pickled: {exc}"
        )
        out.send(message(Op.FAILED, call=msg["call"], started=started, ended=time.time(), **_describe_exception(err)))
        return False
    out.send(message(Op.RESULT, call=msg["call"], value=blob, started=started, ended=time.time(),
                     used=_used(usage_before)))
    return True


def _finish_checkpoints(raised: BaseException | None) -> None:
    """A function that returns waits for its checkpoint in flight (a failed one fails the call);
    one that ended on a preemption waits within the notice's grace; any other failure does not
    wait. Only where the function used `Checkpointer` (its module is then imported)."""
    if "skytasks.checkpointing.async_writer" not in sys.modules:
        return
    if raised is None:
        sys.modules["skytasks.checkpointing.async_writer"].wait_for_saves()
    elif isinstance(raised, preemption.Preempted):
        preemption.wait_for_checkpoints_within_grace()


def _enter_workdir() -> None:
    """`workdir=`: the rank starts there and imports from it (as does a script it starts)."""
    workdir = os.environ.get("SKYTASKS_WORKDIR")
    if not workdir:
        return
    os.chdir(workdir)  # relative paths are relative to the agent's start (the node's home)
    here = os.getcwd()
    sys.path.insert(0, here)
    os.environ["SKYTASKS_WORKDIR"] = here
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)


def dump_stacks_to(file: Any) -> None:
    """SIGUSR1 makes faulthandler write every thread's stack to `file` (a file, or a descriptor).
    So does SIGTERM, before the default action ends the rank: when a scheduler (SLURM's
    preemption, a time limit) signals the whole node at once, where each rank was survives it."""
    import faulthandler

    faulthandler.register(signal.SIGUSR1, file=file, all_threads=True, chain=False)
    faulthandler.register(signal.SIGTERM, file=file, all_threads=True, chain=True)


def _dump_stacks_on_request(stack_fd: int | None = None) -> None:
    """Stacks to the agent's file for this rank. `stack_fd`: a forked rank's template registered
    faulthandler on that descriptor already (see rank_template): the file takes its place."""
    path = os.environ.get("SKYTASKS_STACK_FILE")
    if not path:
        return
    if stack_fd is not None:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, stack_fd)
        os.close(fd)
        return
    global _STACK_FILE
    _STACK_FILE = open(path, "a")  # kept open: faulthandler writes to its descriptor
    dump_stacks_to(_STACK_FILE)


_STACK_FILE: Any = None


_HANDED = HandedFiles(mapped_buffer)  # large arguments' memory files, from the agent


def _take_notices(channel: socket.socket) -> None:
    """The agent's end of the control channel (a socket both ways) says what must reach the rank
    while a call runs: a preemption notice, taken at once, not after the call; and it hands over
    the memory files of large arguments (`control_channel`). It closes when the agent is gone or
    wants the rank gone: the rank leaves then, even if it is blocked in a collective. This thread
    sleeps through every ordinary call."""

    def on_message(msg: dict[str, Any]) -> None:
        if msg["op"] == Op.PREEMPTION:
            preemption.receive(preemption.PreemptionNotice(
                msg["node_rank"], msg["address"], msg["reason"], msg["deadline"], msg["at"]))
        elif msg["op"] == flight_recorder.REQUEST_OP:  # before a stop for a hang: the collectives it entered
            _write_flight_record(msg["path"])

    try:
        serve_control_channel(channel, _HANDED, on_message)
    except (ChannelClosed, OSError):
        os._exit(1)


def _write_flight_record(path: str) -> None:
    """The rank's flight recorder summary to `path`, whole or not at all (the agent reads it)."""
    with open(path + ".part", "w") as out:
        json.dump(flight_recorder.summary(), out)
    os.replace(path + ".part", path)


def main(forked: bool = False, stack_fd: int | None = None) -> None:
    if not forked:  # a forked rank was bound to the agent as it was forked (rank_template)
        _die_with_parent()
    _dump_stacks_on_request(stack_fd)
    preemption.take_signal()  # SLURM's --signal reaches every process of the step, ranks too
    ctrl_fd = int(os.environ["SKYTASKS_CTRL_FD"])
    out = RankWriter(os.fdopen(ctrl_fd, "wb"), int(os.environ["RANK"]), int(os.environ["SKYTASKS_GROUP"]))
    inbound = os.fdopen(os.dup(0), "rb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # user code gets an empty stdin, the frames stay ours
    sys.stdin = open(os.devnull)
    threading.Thread(target=_take_notices, args=(socket.socket(fileno=os.dup(ctrl_fd)),), daemon=True,
                     name="skytasks-notices").start()

    from skytasks import metrics

    metrics._channel = out
    preemption.tell_node = lambda reason: out.send(message(Op.NOTICE, reason=reason, deadline=None, at=time.time()),
                                                   TO_AGENT)
    sys.stdout = RankStream(out, "stdout")
    sys.stderr = RankStream(out, "stderr")
    root = logging.getLogger()
    root.addHandler(ShipLogRecords(out))
    root.setLevel(logging.INFO)

    _enter_workdir()
    # Before torch's group is made here, and for ranks that do not make one (run_script): a
    # script's own init_process_group inherits the choice.
    socket_interface.pick_socket_interface(os.environ["MASTER_ADDR"])
    init_torch = os.environ.get("SKYTASKS_INIT_TORCH", "1") == "1"
    if init_torch:
        try:
            _init_process_group(out)
        except BaseException as exc:  # noqa: BLE001
            out.send(message(Op.FAILED, call=None, started=time.time(), ended=time.time(), **_describe_exception(exc)))
            sys.exit(1)
    out.send(message(Op.READY, pid=os.getpid()))

    while True:
        # Read here, on the thread that runs the call: a warm call wakes one thread of the rank,
        # not a reader thread that then wakes this one (that hand-over was a quarter of a rank's
        # CPU per call at 1,024 ranks on 2 cores). What must reach a rank during a call comes on
        # its control channel instead (`_take_notices`).
        try:
            msg = read_frame(inbound, buffer_for=shared_buffer, by_ref=_HANDED.take)
        except (ChannelClosed, OSError):
            os._exit(1)
        if msg["op"] == Op.CALL:
            if not _run_call(msg, out):
                # A rank that failed leaves at once: its peers then fail fast in their
                # collectives too, and the group is never reused.
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(1)
        elif msg["op"] == Op.CLOSE:
            break

    if init_torch:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
