"""One rank process as its node agent sees it: started in a session of its own, its output
relayed line by line, its exit reported, stopped with SIGTERM then SIGKILL, asked for its stack."""

from __future__ import annotations

import array
import fcntl
import os
import signal
import socket
import termios
import threading
import time
from typing import Any, NamedTuple, Protocol

from skytasks.reactor import ENDED, shared_reactor
from skytasks.wire import PIPE_BYTES, TO_AGENT, FrameParser, FrameWriter, decode, encode, widen_pipe
from skytasks.flight_recorder import BUFFER_ENV, DEFAULT_BUFFER
from skytasks.node.rank_starter import RankStarter
from skytasks.node.rank_template import torchrun_threads
from skytasks.node.slurm_env import slurm_task_environment
from skytasks.protocol import Op, message


class RankHost(Protocol):
    """What a rank process needs of its node agent (the agent is one; nothing here imports it)."""

    scratch: str  # where the ranks' stack files live
    leaving_known: threading.Event  # set once the node is going away
    starter: RankStarter  # forks ranks from the node's warm template, or starts them cold

    def emit(self, msg: dict[str, Any]) -> None: ...
    def emit_encoded(self, chunks: list[Any]) -> None: ...
    def give_notice(self, reason: str, deadline: float | None = None) -> None: ...

class _LineSplitter:
    """A rank's stdout or stderr: bytes in, each whole line relayed (without its newline); what
    is left when the stream ends is a line too.

    `drain` reads what is waiting in the pipe now, out of the reactor's turn: the rank's frames
    (its result) and what C code wrote to fd 1 or 2 come on two streams, and a line written before
    `return` must reach the controller before the result does. It reads through a descriptor of
    its own, closed at the stream's end, so it can never read a number the owner closed and the
    kernel gave to another stream."""

    def __init__(self, rank: RankProcess, name: str, stream: Any):
        self._rank, self._name, self._rest = rank, name, b""
        self._fd: int | None = os.dup(stream.fileno())  # non-blocking: the reactor set it so

    def feed(self, data: bytes) -> None:
        *lines, self._rest = (self._rest + data).split(b"\n")
        for line in lines:
            self._rank.relay_line(line, self._name)

    def drain(self) -> None:
        """What the pipe holds now, and no more: a rank that goes on writing is read in the
        reactor's turn, as every other stream is, not here until it stops."""
        if self._fd is None:
            return
        try:
            waiting = array.array("i", [0])
            fcntl.ioctl(self._fd, termios.FIONREAD, waiting, True)
            left = waiting[0]
            while left > 0:
                data = os.read(self._fd, left)
                if not data:
                    return
                left -= len(data)
                self.feed(data)
        except OSError:  # nothing waiting after all, or the stream is going: the reactor hears it
            return

    def end(self, why: str) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._rest:
            line, self._rest = self._rest, b""
            self._rank.relay_line(line, self._name)
        self._rank.stream_ended(why)


class _Launch(NamedTuple):
    rank: int
    env: dict[str, str]  # what the SPAWN said for it
    full_env: dict[str, str]  # what it starts with
    ctrl_read: int
    ctrl_write: int
    stack_file: str


def start_ranks(agent: RankHost, group: int, specs: list[tuple[int, dict[str, str]]]) -> list[RankProcess]:
    """Every rank of one SPAWN, (rank, env) each, started together: the node's template forks
    them in one go (see rank_template)."""
    launches = []
    for rank, env in specs:
        ctrl_read, ctrl_write = _control_channel()
        # Where the rank's faulthandler writes its stacks on SIGUSR1 (see `stack`).
        stack_file = os.path.join(agent.scratch, f"stack-{group}-{rank}.txt")
        full_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1", "SKYTASKS_STACK_FILE": stack_file,
                    "SKYTASKS_GROUP": str(group)}  # the rank stamps its frames with its group (and rank)
        full_env.setdefault(BUFFER_ENV, DEFAULT_BUFFER)  # torch's flight recorder: read for a hang
        full_env.update(slurm_task_environment(full_env))  # inside a SLURM step: this rank's task variables
        full_env.update(torchrun_threads(full_env))
        launches.append(_Launch(rank, env, full_env, ctrl_read, ctrl_write, stack_file))
    try:
        procs = agent.starter.start_many([(x.full_env, x.ctrl_write) for x in launches])
    except BaseException:
        for x in launches:
            os.close(x.ctrl_read)
        raise
    finally:
        for x in launches:
            os.close(x.ctrl_write)
    return [RankProcess(agent, group, x.rank, x.env, proc, x.ctrl_read, x.stack_file) for x, proc in zip(launches, procs)]


def _control_channel() -> tuple[int, int]:
    """(the agent's end, the rank's end) of a rank's control channel: a socket both ways. The rank
    sends its frames on it (results, lines, logs); the agent sends the rank what must reach it
    even during a call (a preemption notice), since the rank reads its ordinary frames only
    between calls."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for end, option in ((ours, socket.SO_RCVBUF), (theirs, socket.SO_SNDBUF)):
        try:  # a large result in fewer wake-ups, as the widened pipe it replaced (capped by the kernel)
            end.setsockopt(socket.SOL_SOCKET, option, PIPE_BYTES)
        except OSError:
            pass
    return ours.detach(), theirs.detach()


# How long a stopped rank gets to exit on SIGTERM before SIGKILL.
TERM_GRACE_SECONDS = 1.0


class RankProcess:
    """One rank's process: its streams relayed to the controller, its exit reported."""

    def __init__(self, agent: RankHost, group: int, rank: int, env: dict[str, str], proc: Any, ctrl_read: int,
                 stack_file: str):
        """A rank `start_ranks` started: `proc` behaves like a Popen, `ctrl_read` is its channel."""
        self.group, self.rank, self.proc, self.stack_file = group, rank, proc, stack_file
        widen_pipe(self.proc.stdin)  # calls and their arguments
        self.to_rank = FrameWriter(self.proc.stdin)
        # Its control channel, which it reads even mid-call: frames (notices) and fds (hand_fd).
        self._control = socket.socket(fileno=os.dup(ctrl_read))
        self.notices = FrameWriter(self._control.makefile("wb"))
        self._agent = agent
        self.stack_offset = 0  # where the next dump in the stack file starts
        self.device = env.get("SKYTASKS_DEVICE", "cpu")  # "cuda:<i>": the i-th of the node's visible GPUs
        self.stopped_by_agent = False
        # Its three streams are read by the agent's one reader thread (skytasks.reactor), not a
        # thread each: at 8 ranks a node that would be 24 threads waking for every result and line.
        self._open_streams = 3
        self._exit: tuple[int, float] | None = None  # (code, when), once heard
        self._awaiting_drain = False  # the exit is to be reported once its streams have ended
        self._reported = False
        self._streams_lock = threading.Lock()  # the streams' count, the exit and its report
        self._reactor = reactor = shared_reactor()
        self._outputs: list[_LineSplitter] = []
        for stream, name in ((self.proc.stdout, "stdout"), (self.proc.stderr, "stderr")):
            os.set_blocking(stream.fileno(), False)
            self._outputs.append(_LineSplitter(self, name, stream))
        for stream, lines in zip((self.proc.stdout, self.proc.stderr), self._outputs):
            reactor.add(stream, lines.feed, lines.end)
        # Last: its frames drain the two above (_relay_frames), whose adding may feed them here.
        frames = FrameParser()
        reactor.add(os.fdopen(ctrl_read, "rb"), lambda data: self._relay_frames(frames.feed_raw(data)),
                    self.stream_ended)
        # Its end is heard on the same thread as its streams, not in a thread of its own.
        if not reactor.watch_exit(self.proc.pid, self._on_exit):
            threading.Thread(target=self._wait_for_exit, daemon=True).start()

    def _relay_frames(self, frames: list[tuple[int, bytearray]]) -> None:
        """The rank's frames go on to the controller as the rank wrote them (it stamped them with
        its rank and group): no unpickling and pickling again of every result, line and log
        record at the agent, one write for all that one read brought. What C code wrote to the
        rank's fd 1 and 2 before these frames goes first."""
        for lines in self._outputs:
            lines.drain()
        onward: list[bytearray] = []
        for flags, frame in frames:
            if flags & TO_AGENT:  # SIGUSR2 reached this rank: it is the node's notice
                if onward:  # what the rank said before it goes first
                    self._agent.emit_encoded(onward)
                    onward = []
                msg = decode(frame)
                self._agent.give_notice(msg["reason"], msg.get("deadline"))
            else:
                onward.append(frame)
        if onward:
            self._agent.emit_encoded(onward)

    def hand_fd(self, token: int, fd: int) -> bool:
        """`fd` to the rank on its control channel, named `token` (a SHARED frame beside it): the
        memory file of a large argument, which the rank then maps instead of reading it from its
        pipe. True also when the rank has gone (its exit is reported on its own); False only if
        a live rank could not be handed it."""
        frame = b"".join(bytes(chunk) for chunk in encode(message(Op.SHARED, token=token)))
        with self.notices.lock:  # never inside another frame on the same channel
            try:
                socket.send_fds(self._control, [frame], [fd])
            except (BrokenPipeError, ConnectionResetError):
                return True
            except OSError:
                return self.proc.poll() is not None
        return True

    def relay_line(self, raw: bytes, name: str) -> None:
        line = raw.decode("utf-8", "replace")
        self._agent.emit(message(Op.OUTPUT, group=self.group, rank=self.rank, stream=name, line=line))

    def stream_ended(self, why: str) -> None:
        with self._streams_lock:
            self._open_streams -= 1
            report_now = self._open_streams == 0 and self._awaiting_drain
        if report_now:
            self._report()

    # -- its exit, heard on the reactor's thread (or `_wait_for_exit`'s) -------------------------

    def _wait_for_exit(self) -> None:
        """Where no pidfd could be had: wait here, then carry on on the reactor's thread."""
        self.proc.wait()
        self._reactor.call_later(0.0, lambda: self._on_exit(ENDED))

    def _on_exit(self, why: str) -> None:
        code = self.proc.poll()
        if code is None:  # the watch failed to register (why says so): wait the old way
            threading.Thread(target=self._wait_for_exit, daemon=True).start()
            return
        exit_at = time.time()  # before the relays drain: when it really ended, for root-cause order
        self._exit = (code, exit_at)
        if code == -signal.SIGTERM and not self.stopped_by_agent and not self._agent.leaving_known.is_set():
            # Someone signalled the whole node (a scheduler's preemption or cancel): the agent
            # got the same SIGTERM, and its LEAVING, not this exit, may be the news.
            self._reactor.call_later(0.5, self._report_once_drained)
        else:
            self._report_once_drained()

    def _report_once_drained(self) -> None:
        # The relays drain first, so a result or traceback sent just before the exit is reported
        # before the exit itself (`stream_ended` reports then). A grandchild holding a pipe open
        # must not stall this: 2 s at most.
        with self._streams_lock:
            self._awaiting_drain = True
            drained = self._open_streams == 0
        if drained:
            self._report()
        else:
            self._reactor.call_later(2.0, self._report)

    def _report(self) -> None:
        with self._streams_lock:
            if self._reported or self._exit is None:
                return
            self._reported = True
            code, exit_at = self._exit
        if self._agent.leaving_known.is_set():
            return  # the agent's LEAVING says it, with where every rank was
        self._agent.emit(message(Op.EXITED, group=self.group, rank=self.rank, returncode=code, at=exit_at))

    def dump_from_here(self) -> None:
        """The next `last_stack` starts at the file's end now: only what the rank dumps after this."""
        try:
            self.stack_offset = os.path.getsize(self.stack_file)
        except OSError:
            self.stack_offset = 0

    def last_stack(self) -> str:
        """What the rank dumped since the last read (its SIGTERM dump, when it was signalled)."""
        try:
            with open(self.stack_file, "rb") as f:
                f.seek(self.stack_offset)
                return f.read().decode("utf-8", "replace").strip()
        except OSError:
            return ""

    def stack(self, wait: float = 0.5) -> str:
        """Every thread's Python stack, innermost frame first, even while the rank is blocked
        in a C++ collective: faulthandler dumps from its C signal handler, no GIL needed."""
        try:
            before = self.stack_offset = os.path.getsize(self.stack_file)
        except OSError:
            before = 0
        try:
            os.kill(self.proc.pid, signal.SIGUSR1)
        except ProcessLookupError:
            return ""
        deadline = time.monotonic() + wait
        text = ""
        while time.monotonic() < deadline:
            time.sleep(0.05)
            try:
                with open(self.stack_file, "rb") as f:
                    f.seek(before)
                    now = f.read().decode("utf-8", "replace")
            except OSError:
                continue
            if now and now == text:
                break  # written and no longer growing: the dump is whole
            if not now and self.proc.poll() is not None:
                break  # it was already leaving (the rank that failed): no dump is coming
            text = now
        self.stack_offset = before + len(text.encode())
        return text.strip()

    def stop(self) -> None:
        self.stopped_by_agent = True
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return

    def kill(self) -> None:
        self.stopped_by_agent = True
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
