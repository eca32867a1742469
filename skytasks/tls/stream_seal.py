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

The node's end, and the pump both ends run, are skytasks/tls/seal_pump.py.
"""

from __future__ import annotations

import hashlib
import logging
import os
import ssl
import threading
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable

from skytasks.tls.pool_identity import pool_tls
from skytasks.tls.seal_pump import PUMP_LIB, SEALED_ENV, attach_argv, node_prelude

__all__ = ["SEALED_ENV", "UNSEALED_FOR_TESTS", "Identity", "SealFailed", "SealedEnds", "attach_argv", "identity",
           "node_prelude", "seal_controller_end", "wanted"]

# Tests only: streams run in the clear, so a test can show its capture would find the marker.
UNSEALED_FOR_TESTS = "SKYTASKS_TEST_UNSEALED_STREAMS"


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
    made = pool_tls()
    der = ssl.PEM_cert_to_DER_cert(made.cert)
    return Identity(made.cert, made.key, hashlib.sha256(der).hexdigest())


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
