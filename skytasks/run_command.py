"""`skytasks run SCRIPT ARGS...`: `run_script` as a Prefect flow run, as fast as torchrun.

A torchrun user times the whole command. Done in series (Prefect's server, then the flow run,
then the pool, then the ranks) the command would take 1.3x torchrun with a server and 2.8x with
none configured, where Prefect's ephemeral server alone takes seconds to start. So the ranks start
at once, on this thread, and the record is made beside them on another: the flow run, its parent
task run, then everything the call said so far, each line and state at the time it happened
(`HeldObserver`), then the rest live. The command ends when both have: nothing is left out of the
run's record, and Ctrl-C and SIGTERM reach the call as they do anywhere else.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from concurrent.futures import Future
from typing import Any

RECORD_WAIT_SECONDS = 120.0  # after the call: Prefect's ephemeral server may still be starting


class _NoCopiesOnConsole(logging.Filter):
    """Rank lines and notices are printed live by the command itself; Prefect's console copy of
    the record would print them twice."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == "prefect.task_runs" and str(record.msg).startswith(("[rank ", "[skytasks] ")))


def run_command(args: argparse.Namespace) -> int:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # offline: no telemetry tracebacks
    # (Prefect's ephemeral server is given time to start by importing skytasks: ephemeral_timeout.)
    from skytasks.errors import PoolConfigError
    from skytasks.prefect_records.ephemeral_server import start_early_server

    try:  # the arguments, checked before anything starts (Prefect's server included)
        options, call_args = _checked(args)
    except (PoolConfigError, ValueError) as exc:
        print(f"skytasks run: {exc}", file=sys.stderr)
        return 2
    early = start_early_server()  # then at once: with no API configured, Prefect's server takes seconds
    from skytasks.controller.console import ConsoleObserver
    from skytasks.prefect_records.record_queue import HeldObserver
    from skytasks.controller.runner import SHOW_RESOURCES, run_call
    from skytasks.event_bus import EVENT_HOLDER

    try:
        if args.pool and early is not None:
            early.wait_until_up(_server_timeout())  # the block is loaded through it
        if args.pool:
            call, payload = _on_saved_pool(args, options, call_args)
        else:
            call, payload = _on_local_pool(options, call_args, args.min_nodes)
    except (PoolConfigError, ValueError) as exc:  # the saved pool's own checks
        print(f"skytasks run: {exc}", file=sys.stderr)
        return 2
    name = call.options.label  # the script's name, as `run_script` gives it
    held = HeldObserver(ConsoleObserver())
    outcome: Future = Future()
    recorded: Future = Future()
    recorder = threading.Thread(target=_record, args=(call, held, outcome, recorded, early), daemon=True,
                                name="skytasks-record")
    recorder.start()
    shown, sink = SHOW_RESOURCES.set(bool(args.resources)), EVENT_HOLDER.set(held.on_pool_event)
    try:
        outcome.set_result(run_call(call.runtime, payload, call.options, held))
    except BaseException as err:  # noqa: BLE001 - the record hears it, then the user does
        outcome.set_exception(err)
    finally:
        held.close()
        SHOW_RESOURCES.reset(shown)
        EVENT_HOLDER.reset(sink)
    code = _report(name, outcome, recorder, recorded)
    from skytasks.prefect_records.ephemeral_server import flush_records

    flush_records()  # while the server still runs, and without Prefect's at-exit warning
    return code


def end_process(code: int) -> None:
    """End the command's process now, as its normal exit would but without tearing down the
    interpreter: threads joined and Prefect's and skytasks' at-exit steps run (the record's last
    sends, the early server's stop), output flushed, then `os._exit(code)`. Freeing the 1,300-odd
    modules a run with its Prefect record has imported, object by object, takes 0.15-0.4 s on 2
    busy cores after the ranks have ended, all of it on a command timed against torchrun.
    With an interpreter that lacks the shutdown step used here, the process exits as usual."""
    import atexit

    shutdown = getattr(threading, "_shutdown", None)  # what the interpreter's exit runs first
    if shutdown is None:
        return
    shutdown()  # threading's own at-exit calls, then every non-daemon thread joined
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a pipe whose reader has gone: as at a normal exit
            pass
    os._exit(code)


def _checked(args: argparse.Namespace) -> tuple[Any, tuple]:
    """`run_script`'s options from the command line; a local pool's shape defaults to 1 x 1."""
    from skytasks.script import script_options

    local = not args.pool
    fewest, nodes = _node_count(args.nodes, local)
    args.min_nodes = fewest
    nodes = 1 if local and nodes is None else nodes
    procs_per_node = 1 if local and args.procs_per_node is None else args.procs_per_node
    return script_options(args.script, args.args, pool=args.pool, module=args.module, workdir=args.workdir,
                          nodes=nodes, procs_per_node=procs_per_node, timeout_seconds=args.timeout,
                          retries=args.retries, node_recoveries=args.node_recoveries, rank_runs=args.rank_runs)


def _node_count(text: str | None, local: bool) -> tuple[int | None, int | None]:
    """--nodes N, or torchrun's MIN:MAX (an elastic local pool): (min_nodes or None, nodes)."""
    from skytasks.errors import PoolConfigError

    if text is None:
        return None, None
    low, colon, high = text.partition(":")
    try:
        fewest, most = (int(low), int(high)) if colon else (None, int(text))
    except ValueError:
        raise PoolConfigError(f"--nodes: {text!r} is not a count (N) or a range (MIN:MAX)") from None
    if colon and not local:
        raise PoolConfigError(f"--nodes: {text} (a range) is for a local pool; a saved pool's range is its own "
                              "min_nodes and nodes")
    if fewest is not None and not 1 <= fewest <= most:
        raise PoolConfigError(f"--nodes: {text}: MIN must be at least 1 and at most MAX")
    return fewest, most


def _on_local_pool(options: Any, call_args: tuple, min_nodes: int | None = None) -> tuple[Any, Any]:
    """The call on a local pool, made without Prefect: its ranks start while Prefect is imported
    (a second or so) on the recording thread. The pool is what `GPUPool()` of this shape gives."""
    from skytasks.controller.packing import pack_call
    from skytasks.controller.runner import PreparedCall
    from skytasks.pool_spec import PoolSpec
    from skytasks.script import run_on_rank
    from skytasks.wiring import pool_runtime

    spec = PoolSpec(name="local-pool", provider="local", nodes=options.nodes, procs_per_node=options.procs_per_node,
                    accelerators_per_node=None, min_nodes=min_nodes)
    return PreparedCall(run_on_rank, pool_runtime(spec, owner=None), options), pack_call(run_on_rank, call_args, {})


def _on_saved_pool(args: argparse.Namespace, options: Any, call_args: tuple) -> tuple[Any, Any]:
    """The call on a saved pool, loaded through the API (with none configured, its server starts now)."""
    from skytasks.controller.packing import pack_call
    from skytasks.script import task_on_its_pool

    task = task_on_its_pool(options, call_args[0], module=args.module)
    return task.prepare(), pack_call(task.fn, call_args, {})


def _server_timeout() -> float:
    """How long the early server may take: the environment's limit, which importing skytasks set
    (ephemeral_timeout) unless the user set one there or in Prefect's settings files."""
    from skytasks.ephemeral_timeout import FIRST_START_SECONDS, SETTING_ENV

    return float(os.environ.get(SETTING_ENV, FIRST_START_SECONDS))


def _record(call: Any, held: Any, outcome: Future, recorded: Future, early: Any) -> None:
    """The flow run and its parent task run, made while the call runs; ends when the call has."""
    from prefect import flow

    from skytasks.prefect_records.parent_task import record_started_call
    from skytasks.prefect_records.prefect_internals import is_api_log_handler, without_flow_heartbeats

    # Prefect has set its logging up by now (on import, on this thread for a local pool).
    for logger in (logging.getLogger(), logging.getLogger("prefect")):
        for handler in logger.handlers:
            if not is_api_log_handler(handler):
                handler.addFilter(_NoCopiesOnConsole())

    @flow(name=call.options.label, log_prints=False)
    def script_flow() -> list:
        return record_started_call(call, held, outcome)

    try:
        if early is not None:
            early.wait_until_up(_server_timeout())
        with without_flow_heartbeats():  # each would add up to 1 s to a command timed against torchrun
            script_flow()
        recorded.set_result(None)
    except BaseException as err:  # noqa: BLE001 - handed to the command's thread
        recorded.set_exception(err)


def _report(name: str, outcome: Future, recorder: threading.Thread, recorded: Future) -> int:
    """The exit code, with the root cause first; the call's own error comes before the record's."""
    from skytasks.errors import DistributedTaskError, PoolConfigError, ScriptFailed

    try:
        recorder.join(RECORD_WAIT_SECONDS)
    except KeyboardInterrupt:
        print("skytasks run: interrupted while the run was being recorded; its record may be incomplete",
              file=sys.stderr)
        return 130
    error = outcome.exception()
    if isinstance(error, KeyboardInterrupt):
        print("skytasks run: interrupted; every rank was stopped", file=sys.stderr)
        return 130
    if isinstance(error, PoolConfigError):
        print(f"skytasks run: {error}", file=sys.stderr)
        return 2
    if isinstance(error, DistributedTaskError):
        root = error.exceptions[0]
        print(f"skytasks run: {name} failed; root cause: {root}", file=sys.stderr)
        for other in error.exceptions[1:]:
            print(f"skytasks run: also: {str(other).splitlines()[0]}", file=sys.stderr)
        code = root.exit_code if isinstance(root, ScriptFailed) else 1
        return code if 0 < code < 256 else 1
    if error is not None:
        raise error
    if not recorded.done():
        print(f"skytasks run: every rank exited 0, but the Prefect record was not done after "
              f"{RECORD_WAIT_SECONDS:g} s", file=sys.stderr)
        return 1
    if recorded.exception() is not None:
        print(f"skytasks run: every rank exited 0, but the run could not be recorded in Prefect: "
              f"{recorded.exception()!r}", file=sys.stderr)
        return 1
    print(f"skytasks run: {name}: all {len(outcome.result())} rank(s) exited 0", file=sys.stderr)
    return 0
