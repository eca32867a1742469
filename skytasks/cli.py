"""The `skytasks` command: `skytasks run` (a drop-in for torchrun), `skytasks gc` (what pools left
behind), `skytasks check` (a saved pool's pre-flight checks, starting nothing) and `skytasks pools`
(warm pools: skytasks.pools_command).

`skytasks run SCRIPT ARGS...` is `run_script` inside a Prefect flow run named after the script, so
every run is in the UI with a task run per rank; on the terminal each rank's lines print live as
`[rank R] ...`, like torchrun's prefixed output. Exit 0 when every rank exits 0; otherwise the root
cause first, and a non-zero exit (the failing rank's own exit code where it has one).
"""

from __future__ import annotations

import argparse
import sys
from typing import cast


def _run_parser(commands: argparse._SubParsersAction) -> None:
    run = commands.add_parser(
        "run", help="run a torchrun-style script on every rank of a pool, as a Prefect flow run",
        description="Like `torchrun SCRIPT ARGS...`: every rank runs the script unchanged, with torchrun's "
                    "environment. Without --pool, a local pool of --nodes x --procs-per-node ranks.")
    run.add_argument("--pool", help="name of a saved GPUPool block (default: a local pool)")
    run.add_argument("--nodes", "--nnodes", default=None,
                     help="nodes, or MIN:MAX for an elastic local pool as torchrun writes it (default: the pool's, "
                          "or 1 locally)")
    run.add_argument("--procs-per-node", "--nproc-per-node", dest="procs_per_node", type=int, default=None,
                     help="rank processes per node (default: the pool's, or 1 locally)")
    run.add_argument("--workdir", default=None, help="directory every rank starts in (default: the current one)")
    run.add_argument("--timeout", type=float, default=None, help="seconds the whole call may take")
    run.add_argument("--retries", type=int, default=0, help="restart the whole group this many times when the script fails")
    run.add_argument("--node-recoveries", type=int, default=3,
                     help="restart it this many times after a node is lost or preempted (never counted as retries)")
    run.add_argument("--rank-runs", choices=["rank", "node", "head"], default=None,
                     help="Prefect task runs per rank, per node or the head's only (default: per rank up to 64 ranks)")
    run.add_argument("--resources", action="store_true",
                     help="print each rank's CPU, memory and GPU figures as its node samples them")
    run.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module, run as python -m")
    run.add_argument("script")
    run.add_argument("args", nargs=argparse.REMAINDER)


def _gc_parser(commands: argparse._SubParsersAction) -> None:
    gc = commands.add_parser("gc", help="delete what pools left behind: EC2 resources of aws pools that are expired "
                                        "or orphaned; with --slurm, skytasks SLURM jobs past their expiry; with "
                                        "--kubernetes, the pods of kubernetes pools past their lifetime or with no "
                                        "controller")
    gc.add_argument("--slurm", action="store_true", help="sweep SLURM jobs (run where SLURM's commands work) instead")
    gc.add_argument("--kubernetes", action="store_true",
                    help="delete what kubernetes pools left in a namespace past their lifetime, or with no controller")
    gc.add_argument("--namespace", default=None, help="--kubernetes: the namespace (default: the pool's, else 'default')")
    gc.add_argument("--pool", default=None,
                    help="--kubernetes: a saved GPUPool block whose credentials and namespace to use (default: "
                         "in-cluster config or the default kubeconfig)")
    gc.add_argument("--aws-credentials", help="name of a saved AwsCredentials block (default: the environment's)")
    gc.add_argument("--region", default=None)
    gc.add_argument("--endpoint-url", default=None, help="an EC2-compatible endpoint (tests use moto's)")
    gc.add_argument("--grace-minutes", type=float, default=15)
    gc.add_argument("--dry-run", action="store_true", help="say what would be deleted, delete nothing")
    gc.add_argument("--now", type=_utc_time, default=None, metavar="YYYY-MM-DDTHH:MM:SSZ",
                    help="sweep as of this time (with --dry-run: what a later sweep would delete)")


def _check_parser(commands: argparse._SubParsersAction) -> None:
    check = commands.add_parser("check", help="run a saved pool's pre-flight checks without starting anything")
    check.add_argument("--pool", required=True, help="name of a saved GPUPool block")
    check.add_argument("--preflight", action="store_true",
                       help='bring the nodes up, run the "full" node health checks, print the table, end them')


def _utc_time(text: str):
    from datetime import datetime, timezone

    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--now: {text!r} is not a UTC time such as 2026-01-31T12:00:00Z") from None


def _gc(args: argparse.Namespace) -> int:
    """`skytasks gc`: the sweep of the provider the flags name (aws unless --slurm or --kubernetes),
    its plugin's `gc` (skytasks/providers/<name>/gc.py)."""
    from skytasks.providers.registry import imported, plugin

    name = "slurm" if args.slurm else "kubernetes" if args.kubernetes else "aws"
    sweep = plugin(name).gc
    assert sweep is not None, name
    return int(imported(sweep)(args))


def _check(args: argparse.Namespace) -> int:
    """Each check on a line, its verdict first; exit 0 when none failed."""
    from skytasks.blocks.gpu_pool import GPUPool
    from skytasks.errors import PoolConfigError
    from skytasks.providers.checks import checks_for

    try:
        pool = cast(GPUPool, GPUPool.load(args.pool))
    except (ValueError, PoolConfigError) as exc:
        print(f"skytasks check: cannot load pool {args.pool!r}: {exc}", file=sys.stderr)
        return 2
    print(f"skytasks check: pool {args.pool!r} (provider={pool.provider}, nodes={pool.spec().node_count})")
    failed = 0
    for check in checks_for(pool.spec()):
        print(check.line(), flush=True)
        failed += check.passed is False
    print(f"skytasks check: {'all passed' if not failed else f'{failed} failed'}")
    if args.preflight and not failed:
        from skytasks.preflight import command

        return command.run(pool, sys.stdout)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="skytasks")
    commands = parser.add_subparsers(dest="command", required=True)
    _run_parser(commands)
    _gc_parser(commands)
    _check_parser(commands)
    from skytasks.pools_command import add_parser as _pools_parser

    _pools_parser(commands)
    args = parser.parse_args(argv)
    if args.command == "run":
        from skytasks.run_command import end_process, run_command

        code = run_command(args)
        if argv is None:  # this process is the command (`skytasks run`, `python -m skytasks.cli run`)
            end_process(code)
        return code
    if args.command == "check":
        return _check(args)
    if args.command == "pools":
        from skytasks.pools_command import pools_command

        return pools_command(args)
    return _gc(args)


if __name__ == "__main__":
    sys.exit(main())
