"""A torchrun script forked from its rank, which has torch already, instead of a fresh `python SCRIPT`.

Why: a fresh interpreter that imports torch costs 1.3-1.9 s of CPU, once per rank, and on a small
machine that was most of what `skytasks run` spends beyond torchrun (docs/benchmarks.md). A rank of
a script call is forked from its node's template, which imported torch once for the node (see
rank_template); forking the script from there shares those pages instead of importing again.

What the child is, as `python SCRIPT ARGS` started by `subprocess.Popen` from the rank would be:
- stdin is /dev/null, stdout and stderr are pipes the rank relays, every other descriptor closed;
- the script's environment exactly, `sys.argv` as given, `sys.path[0]` the script's directory,
  `__main__` a fresh module whose `__file__` is the script's absolute path;
- signals as an exec'd Python has them: what the rank ignored stays ignored, every handler is
  the default again, SIGPIPE and SIGXFSZ ignored, SIGINT raising KeyboardInterrupt; no
  faulthandler; the root logger without handlers, so the script's `basicConfig` takes effect;
- it ends as an interpreter does: SystemExit's code, 1 and the traceback (the script's frames
  only) for an exception, killed by SIGINT for an unhandled KeyboardInterrupt; its non-daemon
  threads joined and its `atexit` functions run, none of the rank's finalizers.

It starts cold instead (`can_fork` says why not) when the rank has no torch, when the script's
environment differs from the rank's in what an interpreter or torch reads only as it starts, and
when the script's own text names such a variable (a script that sets OMP_NUM_THREADS before its
`import torch` must get a fresh import). A module (`-m`) always starts cold. Linux only.
"""

from __future__ import annotations

import io
import os
import re
import signal
import sys
import warnings
from pathlib import Path
from typing import IO, NoReturn

from skytasks.node.rank_template import (
    READ_AFTER_IMPORT,
    close_fds_above,
    retitle,
    set_environ,
    startup_differs,
    torch_import_env,
    torch_imported_with,
)

# A variable torch or its thread pools read as they load, named in the script's own text.
_SETS_IMPORT_ENV = re.compile(rb"\b(?:OMP|GOMP|KMP|MKL|OPENBLAS|GOTO|TORCH|PYTORCH)_[A-Z0-9_]+")


def can_fork(command: list[str], env: dict[str, str]) -> str | None:
    """None when `python *command` with `env` may be forked from this rank; else why not."""
    if sys.platform != "linux":
        return "not Linux"
    if not command or command[0] == "-m":
        return "a module (-m) starts cold"
    imported = torch_imported_with()
    if imported is None or "torch" not in sys.modules:
        return "this rank has no torch"
    if torch_import_env(env) != imported:
        return "torch was imported with other thread settings"
    if startup_differs(env, dict(os.environ)):
        return "an interpreter start setting differs"
    try:
        source = Path(command[0]).read_bytes()
    except OSError as exc:
        return f"script unreadable: {exc}"  # the cold start says so, as python would
    named = {m.decode() for m in _SETS_IMPORT_ENV.findall(source)} - READ_AFTER_IMPORT
    if named:
        return f"the script names {sorted(named)[0]}"
    return _shadowed(os.path.dirname(os.path.realpath(command[0])))


def _shadowed(folder: str) -> str | None:
    """Why not, when the script's folder has a module of a name this rank imported from
    elsewhere: a fresh interpreter would import the folder's (it comes first on sys.path)."""
    try:
        names = {n[:-3] if n.endswith(".py") else n for n in os.listdir(folder)
                 if n.endswith(".py") or os.path.isfile(os.path.join(folder, n, "__init__.py"))}
    except OSError as exc:
        return f"script folder unreadable: {exc}"
    for name in sorted(names & set(sys.modules)):
        where = getattr(sys.modules[name], "__file__", None) or ""
        if not os.path.realpath(where).startswith(folder + os.sep):
            return f"the script's folder has its own {name!r}"
    return None


def fresh_sys_path(script: str, env: dict[str, str]) -> list[str]:
    """sys.path as `python SCRIPT` with `env` starts with it, asked of the interpreter itself
    (PYTHONPATH's handling, site's .pth files and duplicates are its own): a few milliseconds, once
    a script, against the second of an import of torch."""
    import json
    import subprocess

    rest = subprocess.run([sys.executable, "-c", "import sys, json; print(json.dumps(sys.path[1:]))"], env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, check=True, timeout=60).stdout
    return [os.path.dirname(os.path.realpath(script)), *json.loads(rest)]


class ForkedScript:
    """The script's process, as `subprocess.Popen(..., stdin=DEVNULL, stdout=PIPE, stderr=PIPE)`
    gives it: `pid`, `stdout`, `stderr`, `poll`, `wait`, `kill`. It stays in the rank's process
    group, so stopping the rank's group stops it too."""

    def __init__(self, command: list[str], env: dict[str, str]):
        path = fresh_sys_path(command[0], env)  # before the fork: the child runs no subprocess of ours
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        with warnings.catch_warnings():  # 3.12+ warns of the rank's idle reader thread: the child never needs it
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            _become_script(command, env, path, out_w, err_w)  # never returns
        os.close(out_w)
        os.close(err_w)
        self.pid = pid
        self.args = [sys.executable, *command]
        self.stdout: IO[bytes] = os.fdopen(out_r, "rb")
        self.stderr: IO[bytes] = os.fdopen(err_r, "rb")
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _become_script(command: list[str], env: dict[str, str], path: list[str], out_w: int, err_w: int) -> NoReturn:
    code = 1
    try:
        _fresh_process(env, out_w, err_w)
        retitle(*command)  # `ps` shows `python SCRIPT ARGS`, as for a fresh one (where it fits)
        sys.path[:] = path
        code = _run_main(command)
    except BaseException:  # noqa: BLE001 - our own failure before the script ran: said, then 1
        import traceback

        traceback.print_exc()
    os._exit(code)


def _fresh_process(env: dict[str, str], out_w: int, err_w: int) -> None:
    """What the rank was that a new interpreter would not be, undone."""
    import faulthandler

    ignored = _ignored_signals()  # what an exec keeps: read before anything here changes them
    for signum in (signal.SIGUSR1, signal.SIGTERM):  # the rank's stack dumps (rank_template)
        faulthandler.unregister(signum)
    faulthandler.disable()
    devnull = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((devnull, 0), (out_w, 1), (err_w, 2)):
        os.dup2(fd, target)
    close_fds_above(2)
    for signum in signal.valid_signals():
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:  # an exec keeps what is ignored and resets every handler, Python's and faulthandler's alike
            signal.signal(signum, signal.SIG_IGN if signum in ignored else signal.SIG_DFL)
        except (OSError, ValueError):
            pass  # one the kernel keeps to itself (the real-time signals glibc uses)
    for signum in (signal.SIGPIPE, signal.SIGXFSZ):  # as Python sets them at start
        signal.signal(signum, signal.SIG_IGN)
    if signal.getsignal(signal.SIGINT) == signal.SIG_DFL:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.set_wakeup_fd(-1)
    set_environ(env)
    # Unbuffered, as the script's PYTHONUNBUFFERED=1 makes them: its lines reach the UI as printed.
    streams = {"stdin": io.TextIOWrapper(io.FileIO(0, "r", closefd=False)),
               "stdout": io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True),
               "stderr": io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                          errors="backslashreplace")}
    for name, stream in streams.items():
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    import logging
    import weakref

    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
    for finalizer in list(weakref.finalize._registry):  # type: ignore[attr-defined]
        finalizer.atexit = False  # the rank's (its temporary folder): not this process's to clean up
    try:
        from skytasks import metrics

        metrics._channel = None  # the rank's channel is closed here
    except ImportError:
        pass


def _ignored_signals() -> set[int]:
    """The signals this process ignores, as the kernel has them (Python's own record does not
    know faulthandler's handlers)."""
    with open("/proc/self/status") as f:
        mask = int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)
    return {n for n in range(1, 65) if mask & (1 << (n - 1))}


def _run_main(command: list[str]) -> int:
    """`command` as the interpreter runs a script file, and its exit code."""
    import atexit
    import builtins
    import threading
    import types
    from importlib.machinery import SourceFileLoader

    given, args = command[0], command[1:]
    path = os.path.abspath(given)
    sys.argv = [given, *args]
    main = types.ModuleType("__main__")  # what the interpreter makes of a script: its globals, as they are there
    main.__file__ = path
    main.__builtins__ = builtins  # type: ignore[attr-defined]
    main.__loader__ = SourceFileLoader("__main__", path)
    main.__spec__ = None
    main.__package__ = None
    main.__annotations__ = {}
    main.__cached__ = None  # type: ignore[attr-defined]
    sys.modules["__main__"] = main
    code = 0
    interrupted = False
    try:
        with open(path, "rb") as f:
            compiled = compile(f.read(), path, "exec", dont_inherit=True)
        exec(compiled, main.__dict__)
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException as exc:  # noqa: BLE001 - what an uncaught exception does in a script
        interrupted = isinstance(exc, KeyboardInterrupt)
        _print_uncaught(exc, path)
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # as interpreter shutdown: its threads joined
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            code = code or 120  # as Python ends when it cannot flush its output
    if interrupted:  # as Python 3.8+: killed by the signal, so its parent sees why
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def _print_uncaught(exc: BaseException, path: str) -> None:
    """`sys.excepthook` with the script's traceback from its own first frame on: the frames
    above it (this module's) are not the user's."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != path:
        tb = tb.tb_next
    sys.excepthook(type(exc), exc.with_traceback(tb), tb)
