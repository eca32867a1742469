"""Sealing a controller-to-agent stream that is authenticated but not private.

SLURM's srun I/O (munge proves who started the step, nothing hides its bytes) and a Kubernetes
exec stream over a kubeconfig that skips TLS verification or speaks plain http would carry the
pool's key (PEERS, LEASE), its `env` and every call and result in the clear. On such a stream
the provider seals everything after a handshake: TLS 1.3 run *inside* the stream, its records in
the stream's bytes. TLS 1.3 is the X25519 key agreement, HKDF-SHA256, and an AEAD (AES-GCM or
ChaCha20-Poly1305) with a key per direction and the record counter as the nonce; the node has only
the standard library, whose `ssl` module speaks it, so nothing new is needed on a node.

The controller is the TLS server, with a certificate made for this one stream; the node is the
client and takes only the certificate whose SHA-256 the controller put on the node's command line
(public, not a secret). So a reader of the stream learns nothing, and a man in the middle who
cannot also rewrite the command line cannot take the controller's place toward the node. The
node has no key to prove, though: one who rewrites the stream from its first byte can answer the
handshake in the node's place and read what the controller sends it (docs/security.md, "Streams
that are authenticated but not private", says so).

The sealing runs in its own small process on the node (`PUMP`, `python -c PUMP PIN FD` or
`... PIN --door DOOR`): the agent, its resume and its door see plain bytes on pipes as
they saw the pipe before, so a re-attached stream (a new srun step or exec running the sealed
attach client) is a new transport with a fresh agreement, and the byte counts the resume relies
on are the plain stream's. On the controller the same code pumps between the provider's stream
and a pair of pipes whose ends become the link's inbound/outbound.
"""

from __future__ import annotations

import hashlib
import logging
import os
import ssl
import threading
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable

# Set in the node's bootstrap once its stream is sealed: a Python that restarts itself for the
# env (env_in) keeps the seal it has instead of starting a second one.
SEALED_ENV = "SKYTASKS_STREAM_SEALED"
# Tests only: streams run in the clear, so a test can show its capture would find the marker.
UNSEALED_FOR_TESTS = "SKYTASKS_TEST_UNSEALED_STREAMS"

# The pump, standard library only: the same functions run on the node (as `python -c PUMP`) and
# on the controller (exec'd below), so both ends are one implementation.
PUMP_LIB = r'''
import os, socket, ssl, sys, threading

def _seal_handshake(tls, out, inc, recv, send):
    while True:
        try:
            tls.do_handshake()
            break
        except ssl.SSLWantReadError:
            pending = out.read()
            if pending:
                send(pending)
            data = recv(1 << 16)
            if not data:
                raise ConnectionError("the stream ended during its TLS handshake")
            inc.write(data)
    pending = out.read()
    if pending:
        send(pending)

class _Pipes:
    """The plain side as two pipes (read `rfd`, write `wfd`), as a socket would be used: each
    direction a file description of its own, so one made non-blocking leaves the other as it was."""

    def __init__(self, rfd, wfd):
        self.rfd, self.wfd = rfd, wfd

    def recv(self, n):
        return os.read(self.rfd, n)

    def sendall(self, data):
        view = memoryview(data)
        while view:
            view = view[os.write(self.wfd, view):]

    def shutdown(self, how):
        os.close(self.wfd)

def _pipe():
    r, w = os.pipe()
    try:
        import fcntl
        fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ: 1 MB, a sixteenth of the switches
    except (ImportError, OSError):
        pass
    return r, w

def _seal_pump(tls, inc, out, recv, send, end_out, plain, end_in=None):
    """Both ways until the plain side ends: raw -> decrypt -> plain, plain -> encrypt -> raw.
    `slock` guards the TLS object; `wlock` the order of its output on the raw stream."""
    slock, wlock = threading.Lock(), threading.Lock()

    def down():
        data = b""  # what came with the handshake's last read is in `inc` already
        try:
            while True:
                parts = []
                with slock:
                    if data:
                        inc.write(data)
                    while True:
                        try:
                            got = tls.read(1 << 20)
                        except ssl.SSLWantReadError:
                            break
                        if not got:
                            raise ssl.SSLZeroReturnError()
                        parts.append(got)
                    pending = out.pending
                if pending:
                    with wlock:
                        with slock:
                            more = out.read()
                        send(more)
                if parts:
                    plain.sendall(b"".join(parts))
                data = recv(1 << 20)
                if not data:
                    break
        except (OSError, ssl.SSLError, ValueError):
            pass  # a record that fails its tag ends the stream: nothing altered is passed on
        try:
            plain.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        if end_in is not None:
            end_in()

    def up():
        try:
            while True:
                data = plain.recv(1 << 20)
                if not data:
                    break
                with wlock:
                    with slock:
                        tls.write(data)
                        sealed = out.read()
                    send(sealed)
        except (OSError, ssl.SSLError, ValueError):
            pass
        end_out()

    threading.Thread(target=down, daemon=True).start()
    up()

def _seal_node(pin):
    """The node's end: TLS client on fds 0/1, the controller's certificate checked against `pin`."""
    import hashlib
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # checked below against the pin: no CA is involved
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(inc, out, server_side=False)

    def send(data):
        view = memoryview(data)
        while view:
            view = view[os.write(1, view):]

    _seal_handshake(tls, out, inc, lambda n: os.read(0, n), send)
    if hashlib.sha256(tls.getpeercert(binary_form=True) or b"").hexdigest() != pin:
        sys.stderr.write("skytasks: the stream's TLS certificate is not the controller's: refused\n")
        os._exit(4)
    def end_out():
        try:
            os.close(1)
        except OSError:
            pass
    return tls, inc, out, lambda n: os.read(0, n), send, end_out
'''

PUMP = PUMP_LIB + r'''
import signal
# SLURM signals every process of a step (preemption, `scancel --signal=TERM|USR1|USR2`, the time
# limit) and Ctrl-C reaches a whole process group: the agent answers those with its NOTICE, which
# must still cross this pump. It ends when either side of the stream does, not on a signal.
for _sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGALRM):
    signal.signal(_sig, signal.SIG_IGN)
pin = sys.argv[1]
if sys.argv[2] == "--door":  # a new way to a running agent: its door, then the handshake
    plain = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        plain.connect(sys.argv[3])
    except OSError as e:
        sys.stderr.write("skytasks: cannot reach the agent's door %s: %s\n" % (sys.argv[3], e))
        os._exit(3)
else:  # the agent's stream: the pipes' ends the bootstrap did not keep
    plain = _Pipes(int(sys.argv[2]), int(sys.argv[3]))
try:
    sealed = _seal_node(pin)
except (OSError, ssl.SSLError, ConnectionError) as e:
    sys.stderr.write("skytasks: sealing the stream failed: %s\n" % (e,))
    os._exit(4)
_seal_pump(*sealed, plain)
os._exit(0)
'''

# The node's bootstrap starts with this (the pin and the pump's code in its text): it starts the
# pump beside it, and its own fds 0/1 become the plain end. A Python that restarts for its env
# finds SEALED_ENV set and keeps them.
_NODE_START = r'''
def _seal_stream(pin, pump):
    import os, sys
    if os.environ.get(%(sealed)r):
        return
    down_r, down_w = os.pipe()  # pump -> this process (its fd 0)
    up_r, up_w = os.pipe()  # this process (its fd 1) -> pump
    if os.fork() == 0:
        os.close(down_r)
        os.close(up_w)
        os.set_inheritable(up_r, True)
        os.set_inheritable(down_w, True)
        os.execv(sys.executable, [sys.executable, "-c", pump, pin, str(up_r), str(down_w)])
    os.close(down_w)
    os.close(up_r)
    os.dup2(down_r, 0)
    os.dup2(up_w, 1)
    os.close(down_r)
    os.close(up_w)
    os.environ[%(sealed)r] = "1"
''' % {"sealed": SEALED_ENV}


def wanted(private: bool) -> bool:
    """Whether a stream is to be sealed: every stream that is not private, unless a test turned
    sealing off to show what its capture would find without it (said each time, as loudly as
    SKYTASKS_PEER_TLS=0: a pool's key and env then cross that stream in the clear)."""
    if private:
        return False
    if os.environ.get(UNSEALED_FOR_TESTS) == "1":
        logging.getLogger("skytasks").warning(
            "%s=1: this stream is not private and is NOT sealed; the pool's key and env cross it in the clear "
            "(a switch for tests only)", UNSEALED_FOR_TESTS)
        return False
    return True


@dataclass
class Identity:
    """The controller's TLS certificate and key for one stream, and the pin the node checks."""

    cert: str
    key: str
    pin: str  # SHA-256 of the certificate's DER, hex


def identity() -> Identity:
    from skytasks.controller.peer_tls import pool_tls

    made = pool_tls()
    der = ssl.PEM_cert_to_DER_cert(made.cert)
    return Identity(made.cert, made.key, hashlib.sha256(der).hexdigest())


def node_prelude(pin: str) -> str:
    """Code a bootstrap runs first: its stream sealed, fds 0/1 the plain bytes from then on."""
    return _NODE_START + f"\n_seal_stream({pin!r}, {PUMP!r})\n"


def attach_argv(python: str, pin: str, door: str) -> list[str]:
    """The sealed attach client (node/attach.py's CLIENT, sealed): the door, then the handshake."""
    return [python, "-c", PUMP, pin, "--door", door]


_LIB: dict[str, Any] = {}


def _lib() -> dict[str, Any]:
    if not _LIB:
        exec(compile(PUMP_LIB, "<skytasks stream seal>", "exec"), _LIB)  # the node's own code, here too
    return _LIB


class SealFailed(ConnectionError):
    """The handshake did not complete: the node ended, said something else, or timed out."""


class SealedEnds:
    """The controller's plain end of a sealed stream: `inbound` and `outbound` as the provider's
    stream was (pipes: a buffered reader and writer), `close` ends both and so the pump."""

    def __init__(self, inbound_fd: int, outbound_fd: int):
        self.inbound: BinaryIO = os.fdopen(inbound_fd, "rb")
        self.outbound: BinaryIO = os.fdopen(outbound_fd, "wb")

    def close(self) -> None:
        for f in (self.outbound, self.inbound):
            try:
                f.close()
            except (OSError, ValueError):
                pass


def _context(ident: Identity) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.num_tickets = 0  # no resumption: every stream agrees a fresh key
    # The key reaches OpenSSL through a memory file: never a file on disk.
    fd = os.memfd_create("skytasks-seal") if hasattr(os, "memfd_create") else None
    if fd is None:
        import tempfile

        with tempfile.NamedTemporaryFile("w", suffix=".pem") as f:
            f.write(ident.cert + ident.key)
            f.flush()
            ctx.load_cert_chain(f.name)
        return ctx
    try:
        os.write(fd, (ident.cert + ident.key).encode())
        ctx.load_cert_chain(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)
    return ctx


def _raw_ends(inbound: BinaryIO, outbound: BinaryIO) -> tuple[Callable[[int], bytes], Callable[[bytes], None],
                                                             Callable[[], None], Callable[[], None]]:
    """recv, send, end_out and end_in on the provider's stream. A pipe is read and written through
    descriptors of the pump's own (dups): a file object's lock, held by a blocked read, would
    make its close by the provider wait for the node; and ending the stream is the pump's to do
    (end_out), so the provider's close of its own objects never cuts the seal's last record."""
    try:
        rfd = os.dup(inbound.fileno())
    except (AttributeError, OSError, ValueError):
        rfd = -1
    try:
        wfd = os.dup(outbound.fileno())
    except (AttributeError, OSError, ValueError):
        wfd = -1
    read = (lambda n: os.read(rfd, n)) if rfd >= 0 else (getattr(inbound, "read1", None) or inbound.read)

    def send(data: bytes) -> None:
        if wfd < 0:
            outbound.write(data)
            outbound.flush()
            return
        view = memoryview(data)
        while view:
            view = view[os.write(wfd, view):]

    def end_out() -> None:
        try:
            os.close(wfd) if wfd >= 0 else outbound.close()
        except (OSError, ValueError):
            pass

    def end_in() -> None:
        if rfd >= 0:
            try:
                os.close(rfd)
            except OSError:
                pass

    return read, send, end_out, end_in


def seal_controller_end(inbound: BinaryIO, outbound: BinaryIO, ident: Identity, timeout: float,
                        close: Callable[[], None]) -> SealedEnds:
    """The handshake on the provider's stream (the node speaks first), then a pump between it and
    pipes. SealFailed when it did not complete within `timeout` (then `close` was called)."""
    lib = _lib()
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = _context(ident).wrap_bio(inc, out, server_side=True)
    read, send, end_out, end_in = _raw_ends(inbound, outbound)
    box: dict[str, BaseException | None] = {}

    def handshake() -> None:
        try:
            lib["_seal_handshake"](tls, out, inc, read, send)
            box["error"] = None
        except BaseException as exc:  # noqa: BLE001 - reported below, in words
            box["error"] = exc

    worker = threading.Thread(target=handshake, daemon=True)
    worker.start()
    worker.join(timeout)
    if box.get("error", True) is not None:
        end_out()
        close()
        worker.join(10)
        end_in()
        if "error" not in box:
            raise SealFailed(f"no TLS handshake from the node within {timeout:g}s")
        raise SealFailed(f"the stream's TLS handshake failed: {box['error']}")
    down_r, down_w = lib["_pipe"]()  # pump -> the link's inbound
    up_r, up_w = lib["_pipe"]()  # the link's outbound -> pump

    def pump() -> None:
        try:
            lib["_seal_pump"](tls, inc, out, read, send, end_out, lib["_Pipes"](up_r, down_w), end_in)
        finally:
            os.close(up_r)

    threading.Thread(target=pump, daemon=True, name="skytasks-seal").start()
    return SealedEnds(down_r, up_w)
