"""The `skytasks` command: `skytasks run` (a drop-in for torchrun) and `skytasks gc`.

`skytasks run SCRIPT ARGS...` is `run_script` inside a Prefect flow run named after the script, so
every run is in the UI with a task run per rank; on the terminal each rank's lines print live as
`[rank R] ...`, like torchrun's prefixed output. Exit 0 when every rank exits 0; otherwise the root
cause first, and a non-zero exit (the failing rank's own exit code where it has one).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path


def _run_parser(commands: argparse._SubParsersAction) -> None:
    run = commands.add_parser(
        "run", help="run a torchrun-style script on every rank of a pool, as a Prefect flow run",
        description="Like `torchrun SCRIPT ARGS...`: every rank runs the script unchanged, with torchrun's "
                    "environment. Without --pool, a local pool of --nodes x --procs-per-node ranks.")
    run.add_argument("--pool", help="name of a saved GPUPool block (default: a local pool)")
    run.add_argument("--nodes", type=int, default=None, help="nodes (default: the pool's, or 1 locally)")
    run.add_argument("--procs-per-node", "--nproc-per-node", dest="procs_per_node", type=int, default=None,
                     help="rank processes per node (default: the pool's, or 1 locally)")
    run.add_argument("--workdir", default=None, help="directory every rank starts in (default: the current one)")
    run.add_argument("--timeout", type=float, default=None, help="seconds the whole call may take")
    run.add_argument("--retries", type=int, default=0, help="restart the whole group this many times on failure")
    run.add_argument("--resources", action="store_true",
                     help="print each rank's CPU, memory and GPU figures as its node samples them")
    run.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module, run as python -m")
    run.add_argument("script")
    run.add_argument("args", nargs=argparse.REMAINDER)


def _gc_parser(commands: argparse._SubParsersAction) -> None:
    gc = commands.add_parser("gc", help="delete what pools left behind: EC2 resources of aws pools that are expired "
                                        "or orphaned; with --slurm, skytasks SLURM jobs past their expiry")
    gc.add_argument("--slurm", action="store_true", help="sweep SLURM jobs (run where SLURM's commands work) instead")
    gc.add_argument("--aws-credentials", help="name of a saved AwsCredentials block (default: the environment's)")
    gc.add_argument("--region", default=None)
    gc.add_argument("--endpoint-url", default=None, help="an EC2-compatible endpoint (tests use moto's)")
    gc.add_argument("--grace-minutes", type=float, default=15)
    gc.add_argument("--dry-run", action="store_true", help="say what would be deleted, delete nothing")
    gc.add_argument("--now", type=_utc_time, default=None, metavar="YYYY-MM-DDTHH:MM:SSZ",
                    help="sweep as of this time (with --dry-run: what a later sweep would delete)")


def _utc_time(text: str):
    from datetime import datetime, timezone

    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--now: {text!r} is not a UTC time such as 2026-01-31T12:00:00Z") from None


class _NoRankLinesOnConsole(logging.Filter):
    """The CLI prints rank lines itself, plainly; Prefect's console copy would print them twice."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == "prefect.task_runs" and str(record.msg).startswith("[rank "))


def run_command(args: argparse.Namespace) -> int:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # offline: no telemetry tracebacks
    # Without PREFECT_API_URL the run goes to Prefect's ephemeral server, whose 20 s start limit a
    # busy machine can miss.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    from prefect import flow

    from skytasks.controller.runner import ECHO_RANK_LINES, SHOW_RESOURCES
    from skytasks.errors import DistributedTaskError, PoolConfigError, ScriptFailed
    from skytasks.script import run_script

    if args.pool:
        pool = args.pool
    else:
        from skytasks.blocks.gpu_pool import GPUPool

        try:
            pool = GPUPool(provider="local", nodes=args.nodes or 1, procs_per_node=args.procs_per_node or 1)
        except ValueError as exc:
            print(f"skytasks run: {exc}", file=sys.stderr)
            return 2
    for logger in (logging.getLogger(), logging.getLogger("prefect")):
        for handler in logger.handlers:
            if not type(handler).__name__.startswith("APILogHandler"):
                handler.addFilter(_NoRankLinesOnConsole())
    name = args.script.rsplit(".", 1)[-1] if args.module else Path(args.script).stem

    @flow(name=name, log_prints=False)
    def script_flow() -> list:
        return run_script(args.script, args.args, pool=pool, module=args.module, workdir=args.workdir,
                          nodes=args.nodes if args.pool else None,
                          procs_per_node=args.procs_per_node if args.pool else None,
                          timeout_seconds=args.timeout, retries=args.retries, name=name)

    token = ECHO_RANK_LINES.set(True)
    shown = SHOW_RESOURCES.set(bool(args.resources))
    try:
        results = script_flow()
    except PoolConfigError as exc:
        print(f"skytasks run: {exc}", file=sys.stderr)
        return 2
    except DistributedTaskError as err:
        root = err.exceptions[0]
        print(f"skytasks run: {name} failed; root cause: {root}", file=sys.stderr)
        for other in err.exceptions[1:]:
            print(f"skytasks run: also: {str(other).splitlines()[0]}", file=sys.stderr)
        code = root.exit_code if isinstance(root, ScriptFailed) else 1
        return code if 0 < code < 256 else 1
    except KeyboardInterrupt:
        print("skytasks run: interrupted; every rank was stopped", file=sys.stderr)
        return 130
    finally:
        ECHO_RANK_LINES.reset(token)
        SHOW_RESOURCES.reset(shown)
    print(f"skytasks run: {name}: all {len(results)} rank(s) exited 0", file=sys.stderr)
    return 0


def _slurm_gc(args: argparse.Namespace) -> int:
    from skytasks.blocks.gpu_pool import GPUPool
    from skytasks.providers.reporting import PoolReporter
    from skytasks.providers.slurm.gc import sweep_jobs
    from skytasks.providers.slurm.shell import SlurmShell

    shell = SlurmShell(GPUPool(provider="slurm").spec().slurm, PoolReporter("gc", "slurm"))
    try:
        swept = sweep_jobs(shell, dry_run=args.dry_run, now=args.now, log=lambda line: print(line, file=sys.stderr))
    finally:
        shell.close()
    print(f"skytasks gc: {len(swept)} slurm job(s) {'to cancel' if args.dry_run else 'cancelled'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="skytasks")
    commands = parser.add_subparsers(dest="command", required=True)
    _run_parser(commands)
    _gc_parser(commands)
    args = parser.parse_args(argv)
    if args.command == "run":
        return run_command(args)
    if args.slurm:
        return _slurm_gc(args)
    from skytasks.providers.aws.gc import run_gc

    swept = run_gc(args, log=print)
    print(f"skytasks gc: {len(swept)} pool(s) {'to sweep' if args.dry_run else 'swept'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
