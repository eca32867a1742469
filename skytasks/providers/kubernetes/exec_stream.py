"""A command in a pod, its stdin and stdout as the node's byte stream: the API server's exec
(a websocket, `v4.channel.k8s.io`), authenticated as the pool's identity.

This is how the controller reaches its pods from anywhere the API server is reachable: nothing
listens on the controller's machine and nothing in the cluster is exposed. Each message on the
socket is one channel byte (0 stdin, 1 stdout, 2 stderr, 3 the exit status) and its bytes.

The node's frames arrive on an OS pipe (the controller reads every node's stream on one reactor,
which needs a descriptor), fed by one reader thread per stream; frames to the node are sent on
the socket by the writer's own thread, buffered so that a frame's parts go as one message.
"""

from __future__ import annotations

import collections
import io
import json
import os
import socket
import ssl
import threading
import time
from typing import Any, Optional, Sequence
from urllib.parse import quote, urlencode

from skytasks.providers.kubernetes import api_retry

STDIN, STDOUT, STDERR, STATUS = 0, 1, 2, 3
CHUNK = 1 << 20  # the most bytes of stdin in one websocket message


def _connect(cfg: Any, namespace: str, pod: str, container: str, command: Sequence[str], stdin: bool,
             timeout: float) -> Any:
    """The exec's websocket, asked for again while the API server cannot answer (restarting: the
    connection refused or cut, a 429 or 5xx to the upgrade, its authorizer not yet holding the
    pool's Role) for up to `timeout` seconds in all, the last try at the deadline. Nothing ran in
    the pod before the upgrade was accepted, so asking again never runs a command twice. Any other
    401 or 403, or a TLS refusal (a certificate that does not verify), is raised at once."""
    deadline = time.monotonic() + timeout
    backoff = api_retry.Backoff()
    while True:
        try:
            return _upgrade(cfg, namespace, pod, container, command, stdin,
                            max(1.0, deadline - time.monotonic()))  # one try never runs past the deadline by much
        except Exception as exc:  # noqa: BLE001 - sorted below
            left = deadline - time.monotonic()
            if not _passes(exc) or left <= 0.05:
                raise
            time.sleep(min(backoff.delay(api_retry.retry_after(exc)), left))


def _passes(exc: BaseException) -> bool:
    import websocket

    if isinstance(exc, ssl.SSLError) and not isinstance(exc, (ssl.SSLEOFError, ssl.SSLZeroReturnError,
                                                              ssl.SSLSyscallError)):
        return False  # a certificate refused, by either end: no wait mends it (a cut handshake does pass)
    if isinstance(exc, (websocket.WebSocketConnectionClosedException, websocket.WebSocketTimeoutException)):
        return True  # the upgrade cut off or unanswered: a server going down or not yet up
    if api_retry.status_of(exc) == 403:
        # A restarted API server's RBAC authorizer denies for a moment what the Role grants, in
        # these words; a permission the Role lacks says "cannot create resource" alone.
        body = getattr(exc, "resp_body", None) or b""
        return b"RBAC: " in body and b"not found" in body
    return api_retry.passing(exc)  # refused or reset (OSError); a 429 or 5xx (the bad status's code)


def _upgrade(cfg: Any, namespace: str, pod: str, container: str, command: Sequence[str], stdin: bool,
             timeout: float) -> Any:
    import websocket

    if cfg.refresh_api_key_hook is not None:  # an exec plugin's token (EKS, GKE) is renewed here
        cfg.refresh_api_key_hook(cfg)
    query = [("command", c) for c in command] + [("container", container), ("stdout", "true"), ("stderr", "true"),
                                                  ("stdin", "true" if stdin else "false")]
    host = cfg.host.replace("https://", "wss://", 1).replace("http://", "ws://", 1)
    url = f"{host}/api/v1/namespaces/{quote(namespace)}/pods/{quote(pod)}/exec?{urlencode(query)}"
    # The client's own auth settings (a bearer token from a kubeconfig, a service account or an
    # exec plugin), as its REST calls send them.
    headers = [f"{a['key']}: {a['value']}" for a in cfg.auth_settings().values() if a.get("in") == "header" and a.get("value")]
    sslopt: dict[str, Any] = {"cert_reqs": ssl.CERT_REQUIRED if cfg.verify_ssl else ssl.CERT_NONE}
    if cfg.ssl_ca_cert:
        sslopt["ca_certs"] = cfg.ssl_ca_cert
    if cfg.cert_file:
        sslopt["certfile"] = cfg.cert_file
    if cfg.key_file:
        sslopt["keyfile"] = cfg.key_file
    if cfg.assert_hostname is not None:
        sslopt["check_hostname"] = cfg.assert_hostname
    if getattr(cfg, "tls_server_name", None):
        sslopt["server_hostname"] = cfg.tls_server_name
    return websocket.create_connection(url, header=headers, sslopt=sslopt, subprotocols=["v4.channel.k8s.io"],
                                       timeout=timeout, enable_multithread=True)


class _SocketWriter(io.RawIOBase):
    """stdin of the command: each write one websocket message (buffered above, in chunks)."""

    def __init__(self, ws: Any, pod: str):
        self._ws, self._pod = ws, pod

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        import websocket  # loaded already: the stream was made with it

        view = memoryview(data).cast("B")
        try:
            for at in range(0, len(view), CHUNK):
                self._ws.send_binary(b"\x00" + bytes(view[at:at + CHUNK]))
        except websocket.WebSocketException as exc:
            # As a pipe says it: the stream above (controller/reconnect.py) takes an OSError for
            # a break and re-attaches; a websocket's own type (the apiserver restarted) escaped it.
            raise BrokenPipeError(f"the exec stream to pod {self._pod} closed: {exc}") from exc
        return len(view)


class PodExec:
    """One exec stream. `inbound` is the command's stdout as a file with a descriptor, `outbound`
    its stdin; `stderr_tail` keeps its last lines and `status` its exit status once it ended."""

    def __init__(self, cfg: Any, namespace: str, pod: str, container: str, command: Sequence[str], *,
                 stdin: bool = True, timeout: float = 30.0):
        self.pod = pod
        self._ws = _connect(cfg, namespace, pod, container, command, stdin, timeout)
        self._ws.settimeout(None)  # a node's stream may be quiet between calls; heartbeats say if it is alive
        read_fd, self._write_fd = os.pipe()
        self.inbound = os.fdopen(read_fd, "rb", buffering=0)
        self.outbound = io.BufferedWriter(_SocketWriter(self._ws, pod), buffer_size=CHUNK)
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=20)
        self.status: Optional[dict[str, Any]] = None
        self.ended = threading.Event()
        self._closed = False
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._pump, name=f"skytasks-exec-{pod}", daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        partial = b""
        try:
            while True:
                opcode, data = self._ws.recv_data()
                if opcode == 8 or not data and opcode != 2:  # close
                    break
                if not data:
                    continue
                channel, payload = data[0], memoryview(data)[1:]
                if channel == STDOUT:
                    while payload:
                        written = os.write(self._write_fd, payload)
                        payload = payload[written:]
                elif channel == STDERR:
                    text = (partial + bytes(payload)).decode("utf-8", "replace")
                    *lines, rest = text.split("\n")
                    self.stderr_tail.extend(ln for ln in lines if ln.strip())
                    partial = rest.encode()[-2000:]
                elif channel == STATUS:
                    try:
                        self.status = json.loads(bytes(payload))
                    except ValueError:
                        self.status = {"status": "Failure", "message": bytes(payload).decode("utf-8", "replace")}
        except Exception:  # noqa: BLE001 - the socket closed or broke: the stream ends either way
            pass
        finally:
            if partial.strip():
                self.stderr_tail.append(partial.decode("utf-8", "replace"))
            try:
                os.close(self._write_fd)
            except OSError:
                pass
            self.ended.set()

    def exit_code(self) -> Optional[int]:
        """The command's exit code, once the stream ended (0 on Success)."""
        if self.status is None:
            return None
        if self.status.get("status") == "Success":
            return 0
        for cause in (self.status.get("details") or {}).get("causes") or []:
            if cause.get("reason") == "ExitCode":
                return int(cause.get("message", 1))
        return 1

    def last_words(self) -> str:
        said = " / ".join(self.stderr_tail)
        if self.status and self.status.get("status") != "Success" and self.status.get("message"):
            said = f"{said} / {self.status['message']}" if said else str(self.status["message"])
        return said[-600:]

    def close(self) -> None:
        """End the stream: the command's stdin closes with it, and the node agent ends."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        # The socket is shut first: the reader thread holds the websocket's read lock while it
        # waits in recv, and a close handshake would wait for that lock for ever on a stream
        # whose far end froze (a node that stopped reporting). Shut, the recv returns and the
        # reader ends; the API server sees the connection close and ends the command's stdin.
        sock = getattr(self._ws, "sock", None)
        try:
            if sock is not None:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._ws.shutdown()
        except Exception:  # noqa: BLE001
            pass
        self.ended.wait(5)
        try:
            self.inbound.close()
        except OSError:
            pass


def run(cfg: Any, namespace: str, pod: str, container: str, command: Sequence[str], timeout: float = 60.0
        ) -> tuple[int, bytes, str]:
    """A short command with no stdin: (exit code, stdout, what it said on stderr)."""
    stream = PodExec(cfg, namespace, pod, container, command, stdin=False, timeout=timeout)
    chunks = []
    cut = threading.Timer(timeout, stream.close)  # a stream that hangs is ended, not waited on forever
    cut.daemon = True
    cut.start()
    try:
        while chunk := stream.inbound.read(1 << 16):
            chunks.append(chunk)
        stream.ended.wait(timeout)
    finally:
        cut.cancel()
        stream.close()
    code = stream.exit_code()
    return (1 if code is None else code), b"".join(chunks), stream.last_words()
