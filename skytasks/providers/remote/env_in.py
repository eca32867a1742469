"""The pool's `env` reaches an SSH node's Python over the channel's stdin, never its command line.

A remote command line is the node's to show: `ps` lists it to every user there, and sshd may log
it. The pool's `env` holds secrets (the AWS credentials of `aws_credentials`, a user's tokens), so
the remote command is only `cd && PYTHONPATH=... exec python -c <bootstrap> ARGS`, and the
controller writes the environment on the channel right after it started the command, in the same
breath (no round trip of its own): one line, `frame(env)`, a fixed-width length and then the JSON.

The bootstrap (`ENV_IN`, standard library only) reads exactly that line from fd 0, byte-exact with
os.read so the stream after it is untouched (the agent's frames), and puts it into os.environ. A
variable the interpreter or the dynamic loader reads only as they start (PYTHON*, LD_*, ...) would
not take effect that late: where the env changes one, the Python starts again with it (`exec`,
same pid, same stdin), which costs an interpreter start only for such an env. PYTHONPATH stays on
the command line, as the provider composes it there.
"""

from __future__ import annotations

import json
import shlex

from skytasks.providers.remote import python_check

WIDTH = 10  # the length's digits; then a newline, then the JSON
STARTUP_PREFIXES = ("PYTHON", "LD_", "MALLOC_", "GLIBC_")  # as skytasks.node.rank_template has them
_READ = "SKYTASKS_ENV_READ"  # set across the one restart: the env is in this process already

# Defines `_env_in(restart)`, a no-op in a Python that restarted itself for it.
ENV_IN = r"""
def _env_in(restart=True):
    import json, os, sys
    if os.environ.pop(%(read)r, None):
        return
    def take(n):
        got = b""
        while len(got) < n:
            more = os.read(0, n - len(got))
            if not more:
                sys.exit("skytasks: the channel ended before the node's environment came")
            got += more
        return got
    env = json.loads(take(int(take(%(width)d + 1))))
    startup = [k for k, v in env.items() if k.startswith(%(prefixes)r) and os.environ.get(k) != v]
    os.environ.update(env)
    argv = getattr(sys, "orig_argv", None)
    if restart and startup and argv and sys.executable:
        os.environ[%(read)r] = "1"
        os.execv(sys.executable, [sys.executable] + argv[1:])
""" % {"read": _READ, "width": WIDTH, "prefixes": STARTUP_PREFIXES}

# The agent, behind the env and the check of its Python (python_check.AGENT_START's argv).
AGENT_START = ENV_IN + "\n_env_in()\n" + python_check.AGENT_START
# `skytasks check`: the env, then the check alone.
PROBE = ENV_IN + "\n_env_in()\n" + python_check.PROBE
# pip_packages: the env, then pip in its place (`python -c PIP install ...`), so pip sees it all.
PIP = ENV_IN + r"""
_env_in(restart=False)
import os, sys
os.execv(sys.executable, [sys.executable, "-m", "pip"] + sys.argv[1:])
"""


def sent(env: dict[str, str]) -> dict[str, str]:
    """What travels on stdin: all of `env` but PYTHONPATH (the command line's, composed there)."""
    return {k: v for k, v in env.items() if k != "PYTHONPATH"}


def frame(env: dict[str, str]) -> bytes:
    """The one line the bootstrap reads first."""
    data = json.dumps(sent(env)).encode()
    return b"%0*d\n" % (WIDTH, len(data)) + data


def command(python: str, code: str, args: str = "", pythonpath: str | None = None) -> str:
    """`cd && [PYTHONPATH=...] exec python -c <code> ARGS`: nothing of the env but PYTHONPATH
    (given here as shell text, so `$HOME` in it expands)."""
    path = f"PYTHONPATH={pythonpath} " if pythonpath else ""
    return f"cd && {path}exec {python} -c {shlex.quote(code)}" + (f" {args}" if args else "")
