"""The node's end of a sealed stream (skytasks.tls.stream_seal), as the code a node runs.

The sealing runs in its own small process on the node (`PUMP`, `python -c PUMP PIN FD` or
`... PIN --door DOOR`): the agent, its resume and its door see plain bytes on pipes as
they saw the pipe before, so a re-attached stream (a new srun step or exec running the sealed
attach client) is a new transport with a fresh agreement, and the byte counts the resume relies
on are the plain stream's. On the controller the same code pumps between the provider's stream
and a pair of pipes whose ends become the link's inbound/outbound.

Here as text, standard library only (a node has nothing else): `PUMP_LIB` (the handshake and the
pump, which the controller's end runs too: one implementation for both), `PUMP` (the node's own
process) and `node_prelude` (what a bootstrap runs first).
"""

from __future__ import annotations

# Set in the node's bootstrap once its stream is sealed: a Python that restarts itself for the
# env (env_in) keeps the seal it has instead of starting a second one.
SEALED_ENV = "SKYTASKS_STREAM_SEALED"

# The pump, standard library only: the same functions run on the node (as `python -c PUMP`) and
# on the controller (exec'd by stream_seal.py), so both ends are one implementation.
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
NODE_START = r'''
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


def node_prelude(pin: str) -> str:
    """Code a bootstrap runs first: its stream sealed, fds 0/1 the plain bytes from then on."""
    return NODE_START + f"\n_seal_stream({pin!r}, {PUMP!r})\n"


def attach_argv(python: str, pin: str, door: str) -> list[str]:
    """The sealed attach client (node/attach.py's CLIENT, sealed): the door, then the handshake."""
    return [python, "-c", PUMP, pin, "--door", door]
