"""The watchdog on a launched node: it ends the machine when nobody can any more.

Teardown by the controller covers exit, errors, Ctrl-C, SIGTERM and cancellation. It cannot cover
a controller that is SIGKILLed, loses its network or whose machine dies: then this script, started
first thing at boot from the user-data, shuts the node down, and the instance (launched with
shutdown behaviour "terminate") is gone. Two rules:

- idle: the node agent writes the heartbeat file whenever the controller is heard. When it is
  older than `--idle-seconds` (or was never written, counting from boot) the node is unwanted.
- done: a heartbeat file with mtime 1 is the agent saying the node is no longer wanted (a warm
  pool's keep-warm time ran out): the machine ends now.
- lifetime: past `--max-lifetime-seconds` from boot the node goes, whatever else is happening.
  Without the flag (the pool's `max_lifetime_minutes` is None) there is no lifetime rule: a node
  with a live controller runs as long as the work does, and idleness alone ends it.

It also watches for a spot interruption: with `--notice-file`, it asks the instance metadata
service (IMDSv2: a session token first) for `spot/instance-action` every `--notice-every` seconds,
and when EC2 has scheduled the node's end (about two minutes ahead) writes the notice where the
node agent reads it, which tells the controller and every rank (`rank_info().preempted`).

Standard library only: it runs on the image's own python3, before any venv exists. This file is
copied verbatim into the user-data, so keep it small.
"""

import argparse
import json
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


def verdict(now: float, started_at: float, heartbeat_at: float | None, idle: float,
            max_lifetime: float | None) -> str | None:
    """Why the node should end now, or None while it is wanted. `max_lifetime` None: no cap.
    A heartbeat file whose mtime is 1 is the agent's own word that the node is done (a warm pool
    nobody held for keep_warm_minutes): the node ends now, not idle_minutes later."""
    if heartbeat_at == 1:
        return "the node's agent ended it (a warm pool nobody held for keep_warm_minutes)"
    if max_lifetime is not None and now - started_at >= max_lifetime:
        return f"reached max lifetime ({max_lifetime:.0f}s)"
    last = max(started_at, heartbeat_at or 0.0)
    if now - last >= idle:
        return f"controller silent for {now - last:.0f}s (idle limit {idle:.0f}s)"
    return None


def instance_action(metadata_url: str, timeout: float = 2.0) -> dict | None:
    """EC2's scheduled action for this spot instance ({"action": "terminate", "time": ...}), or
    None while there is none (404) or the service does not answer."""
    import urllib.error
    import urllib.request

    try:
        token_request = urllib.request.Request(f"{metadata_url}/latest/api/token", method="PUT",
                                               headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"})
        with urllib.request.urlopen(token_request, timeout=timeout) as r:
            token = r.read().decode()
        action_request = urllib.request.Request(f"{metadata_url}/latest/meta-data/spot/instance-action",
                                                headers={"X-aws-ec2-metadata-token": token})
        with urllib.request.urlopen(action_request, timeout=timeout) as r:
            return json.loads(r.read().decode())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def write_notice(path: str, action: dict) -> None:
    """The notice as the node agent reads it, whole (a rename): reason and deadline (epoch)."""
    import calendar

    deadline = None
    try:
        deadline = calendar.timegm(time.strptime(action.get("time", ""), "%Y-%m-%dT%H:%M:%SZ"))
    except ValueError:
        pass
    reason = f"EC2 spot interruption: instance-action {action.get('action', '?')} at {action.get('time', '?')}"
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"reason": reason, "deadline": deadline}, f)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="skytasks-watchdog")
    parser.add_argument("--heartbeat-file", required=True)
    parser.add_argument("--idle-seconds", type=float, required=True)
    parser.add_argument("--max-lifetime-seconds", type=float, default=None, help="default: no lifetime cap")
    parser.add_argument("--check-every", type=float, default=30.0)
    parser.add_argument("--started-at", type=float, default=None, help="epoch seconds; default: boot time")
    parser.add_argument("--shutdown-command", default="shutdown -h now")
    parser.add_argument("--notice-file", default=None, help="where a spot interruption notice is written")
    parser.add_argument("--metadata-url", default="http://169.254.169.254", help="the instance metadata service")
    parser.add_argument("--notice-every", type=float, default=5.0)
    args = parser.parse_args(argv)
    started_at = args.started_at if args.started_at is not None else node_started_at()
    next_check = 0.0
    while True:
        if args.notice_file and not os.path.exists(args.notice_file):
            action = instance_action(args.metadata_url)
            if action:
                write_notice(args.notice_file, action)
                print(f"skytasks watchdog: spot interruption notice: {action}", file=sys.stderr, flush=True)
        if time.monotonic() < next_check:
            time.sleep(args.notice_every)
            continue
        next_check = time.monotonic() + args.check_every
        try:
            heartbeat_at = os.stat(args.heartbeat_file).st_mtime
        except OSError:
            heartbeat_at = None
        reason = verdict(time.time(), started_at, heartbeat_at, args.idle_seconds, args.max_lifetime_seconds)
        if reason:
            print(f"skytasks watchdog: {reason}; running: {args.shutdown_command}", file=sys.stderr, flush=True)
            return subprocess.call(args.shutdown_command, shell=True)
        time.sleep(args.notice_every if args.notice_file else args.check_every)


if __name__ == "__main__":
    sys.exit(main())
