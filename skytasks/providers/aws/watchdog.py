"""The watchdog on a launched node: it ends the machine when nobody can any more.

Teardown by the controller covers exit, errors, Ctrl-C, SIGTERM and cancellation. It cannot cover
a controller that is SIGKILLed, loses its network or whose machine dies: then this script, started
first thing at boot from the user-data, shuts the node down, and the instance (launched with
shutdown behaviour "terminate") is gone. Two rules:

- idle: the node agent writes the heartbeat file whenever the controller is heard. When it is
  older than `--idle-seconds` (or was never written, counting from boot) the node is unwanted.
- lifetime: past `--max-lifetime-seconds` from boot the node goes, whatever else is happening.

Standard library only: it runs on the image's own python3, before any venv exists. This file is
copied verbatim into the user-data, so keep it small.
"""

import argparse
import os
import subprocess
import sys
import time


def node_started_at() -> float:
    """When the machine booted: the lifetime clock, and the idle clock until a first heartbeat."""
    try:
        with open("/proc/uptime") as f:
            return time.time() - float(f.read().split()[0])
    except OSError:
        return time.time()


def verdict(now: float, started_at: float, heartbeat_at: float | None, idle: float, max_lifetime: float) -> str | None:
    """Why the node should end now, or None while it is wanted."""
    if now - started_at >= max_lifetime:
        return f"reached max lifetime ({max_lifetime:.0f}s)"
    last = max(started_at, heartbeat_at or 0.0)
    if now - last >= idle:
        return f"controller silent for {now - last:.0f}s (idle limit {idle:.0f}s)"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="skytasks-watchdog")
    parser.add_argument("--heartbeat-file", required=True)
    parser.add_argument("--idle-seconds", type=float, required=True)
    parser.add_argument("--max-lifetime-seconds", type=float, required=True)
    parser.add_argument("--check-every", type=float, default=30.0)
    parser.add_argument("--started-at", type=float, default=None, help="epoch seconds; default: boot time")
    parser.add_argument("--shutdown-command", default="shutdown -h now")
    args = parser.parse_args(argv)
    started_at = args.started_at if args.started_at is not None else node_started_at()
    while True:
        try:
            heartbeat_at = os.stat(args.heartbeat_file).st_mtime
        except OSError:
            heartbeat_at = None
        reason = verdict(time.time(), started_at, heartbeat_at, args.idle_seconds, args.max_lifetime_seconds)
        if reason:
            print(f"skytasks watchdog: {reason}; running: {args.shutdown_command}", file=sys.stderr, flush=True)
            return subprocess.call(args.shutdown_command, shell=True)
        time.sleep(args.check_every)


if __name__ == "__main__":
    sys.exit(main())
