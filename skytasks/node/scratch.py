"""The agent's scratch folder (rank stack files, its door, its log once detached), and the sweep
of those left by agents that were killed.

An agent removes its folder on every way out it sees (node/agent.py `_end_ranks`), but one killed
outright (SIGKILL, the OOM killer, a machine's sshd taking its sessions down) cannot, and a node
that lives for months (an SSH host, a SLURM node) would gather them in its temp folder. So each
agent, as it starts, removes the folders whose agent is gone. "Gone" must hold twice over, since
the temp folder may be shared with agents this one cannot see (another PID namespace):
- the agent's pid, in the folder's name, is no process here; and
- its door, a listening AF_UNIX socket while the agent lives, refuses a connection
  (ECONNREFUSED: a socket file with no listener), or there never was a door and the folder is
  older than a day (a door can fail to open: see node/reattach.py).
A folder changed in the last minute is left for a later sweep. Those of agents from before the
pid was in the name are judged by the door alone; other users' folders and anything else in the
temp folder are never touched."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import tempfile
import time

PREFIX = "skytasks-agent-"
DOORLESS_DAYS = 1.0
# A folder changed this recently is never judged: an agent between its door's bind and listen
# refuses too, and one in another PID namespace is not protected by its pid.
SETTLED_SECONDS = 60.0


def make() -> str:
    """A fresh, private (0700) scratch folder for this agent, after sweeping the dead ones."""
    try:
        sweep()
    except Exception:  # noqa: BLE001 - the sweep is housekeeping, never a reason for an agent not to start
        pass
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")


def sweep(root: str | None = None) -> list[str]:
    """Remove the scratch folders under `root` (the temp folder) whose agent is gone; their paths."""
    root = root or tempfile.gettempdir()
    removed = []
    for name in os.listdir(root):
        if not name.startswith(PREFIX):
            continue
        path = os.path.join(root, name)
        try:
            if _ours(path) and _gone(name, path):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        except OSError:  # it went while we looked (another agent's sweep), or is not ours to read
            continue
    return removed


def _ours(path: str) -> bool:
    st = os.lstat(path)
    return st.st_uid == os.getuid() and os.path.isdir(path) and not os.path.islink(path)


def _gone(name: str, path: str) -> bool:
    age = time.time() - os.lstat(path).st_mtime
    if age < SETTLED_SECONDS:
        return False
    pid = _pid_in(name)
    if pid is not None and _alive(pid):
        return False
    door = os.path.join(path, "door.sock")
    if not os.path.exists(door):
        # No door: a pid-named folder whose agent is dead never opened one (or it is between
        # mkdtemp and the door's bind, but then its pid is alive); judged by its age.
        return pid is not None and age > DOORLESS_DAYS * 86400
    return _refused(door)


def _pid_in(name: str) -> int | None:
    head = name[len(PREFIX):].split("-", 1)[0]
    if not (head.isascii() and head.isdigit() and len(head) <= 10 and "-" in name[len(PREFIX):]):
        return None
    return int(head)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _refused(door: str) -> bool:
    """Whether nothing listens at `door`. A live door takes the connection and, as it does for any
    client that does not finish the handshake, closes it."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(door)
    except OSError as exc:
        return exc.errno == errno.ECONNREFUSED
    finally:
        s.close()
    return False


WARM_LOG_ENV = "SKYTASKS_WARM_LOG"  # a local warm pool's agent: where its stderr goes (set by the provider)
WARM_LOG_DIR_PREFIX = "skytasks-warm-"


def remove_warm_log() -> None:
    """A local warm pool's agents write their stderr to `node<N>.log` in the pool's private folder
    (providers/local). When the pool ends by itself (nobody held it for its keep-warm time),
    nobody else is left to remove them: each agent removes its own log as it ends, and the folder
    goes with the last (rmdir removes only an empty folder). Only a file named so, in a folder
    named so, is ever removed."""
    path = os.environ.get(WARM_LOG_ENV, "")
    folder, name = os.path.split(path)
    if not (name.startswith("node") and name.endswith(".log")
            and os.path.basename(folder).startswith(WARM_LOG_DIR_PREFIX)):
        return
    for remove in (lambda: os.unlink(path), lambda: os.rmdir(folder)):
        try:
            remove()
        except OSError:
            pass  # gone already, or another node's log still in it
