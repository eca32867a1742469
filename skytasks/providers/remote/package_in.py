"""The controller's skytasks onto a node whose only way in is the agent's own stream (a SLURM
step, a Kubernetes exec): the node side of that hand-over, shared by both bootstraps.

`_package_in(home)` (standard library only) answers "have" when `home` already holds this
version (content-addressed by the bundle's digest, so a shared home or a reused pod gets it once)
or "need", then reads exactly the bundle's bytes from fd 0, unpacks them beside `home` and renames
them into place (a half-unpacked tree is never used), and puts `home` first on PYTHONPATH for the
agent the bootstrap then execs. The controller sends the bundle (`ssh.nodes.package_bundle`) only
after "need".
"""

from __future__ import annotations

import threading
from typing import BinaryIO, Callable

PACKAGE_IN = r"""
def _package_in(home, size):
    import io, os, shutil, sys, tarfile
    have = os.path.isdir(os.path.join(home, "skytasks"))
    os.write(1, b"have\n" if have else b"need\n")
    if not have:
        data = bytearray()
        while len(data) < size:
            chunk = os.read(0, size - len(data))
            if not chunk:
                sys.exit("skytasks: the stream closed before the package arrived")
            data += chunk
        tmp = home + ".%d" % os.getpid()
        tarfile.open(fileobj=io.BytesIO(bytes(data))).extractall(tmp)
        try:
            os.rename(tmp, home)
        except OSError:  # another node on the same home was first
            shutil.rmtree(tmp, ignore_errors=True)
    path = os.path.abspath(home)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (path, os.environ.get("PYTHONPATH")) if p)
"""


def read_line(inbound: BinaryIO, timeout: float, close: Callable[[], None]) -> bytes:
    """A bootstrap's next line on the controller's side, or b"" when the stream ended or said
    nothing within `timeout` (then it is closed: `close`)."""
    box: dict[str, bytes] = {}
    reader = threading.Thread(target=lambda: box.setdefault("line", inbound.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if reader.is_alive():
        close()
        reader.join(10)
    return box.get("line", b"")
