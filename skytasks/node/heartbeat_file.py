"""The node agent's heartbeat file, written so that nobody else's file is ever written through it.

On a shared machine (a SLURM node's /tmp) another user could put a link, or a file of their own,
where the heartbeat goes. The file is opened without following a link (O_NOFOLLOW) and written
only when it is this user's: a stranger's file or link is left alone, and the heartbeat unsaid
(the pool's own folder, 0700, is where it belongs: see providers/slurm/job.py). Standard library
only: the agent imports it.
"""

from __future__ import annotations

import os


def touch(path: str, text: str | None = None, mtime: float | None = None) -> bool:
    """Write `text` (None: leave the content) and set the mtime (`mtime`, else now); False when
    the file cannot be, or is not this user's to be, written."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_TRUNC if text is not None else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError:  # ELOOP: a link in its place; EACCES: someone else's
        return False
    try:
        if os.fstat(fd).st_uid != os.getuid():
            return False
        if text is not None:
            os.write(fd, text.encode())
        os.utime(fd, None if mtime is None else (mtime, mtime))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
