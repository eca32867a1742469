"""What a launch shows while it waits: the console (rich), and inside a flow the flow run's logs
and a progress artifact."""

from __future__ import annotations


def flow_run_id() -> str | None:
    try:
        from prefect.context import FlowRunContext

        ctx = FlowRunContext.get()
        return str(ctx.flow_run.id) if ctx and ctx.flow_run else None
    except Exception:  # noqa: BLE001
        return None



class LaunchProgress:
    """Launch progress on the console (rich), and as a Prefect progress artifact inside a flow."""

    def __init__(self, pool_id: str):
        from rich.console import Console

        self._console = Console(stderr=True)
        self._pool_id = pool_id
        self._artifact = None
        self._last = None

    def __call__(self, ready: int, total: int, detail: str) -> None:
        if (ready, detail) == self._last:
            return  # print changes only
        self._last = (ready, detail)
        line = f"{self._pool_id}: {ready}/{total} nodes ready - {detail}"
        self._console.print(f"[bold]skytasks aws[/bold] {line}", highlight=False, soft_wrap=True)
        if flow_run_id() is None:
            return
        try:
            from prefect import get_run_logger
            from prefect.artifacts import create_progress_artifact, update_progress_artifact

            get_run_logger().info(line)  # the cost line and progress in the flow run's own logs

            percent = 100.0 * ready / max(total, 1)
            if self._artifact is None:
                self._artifact = create_progress_artifact(
                    percent, key=f"{self._pool_id}-launch", description=f"nodes of {self._pool_id} ready")
            else:
                update_progress_artifact(self._artifact, percent)
        except Exception:  # noqa: BLE001 - progress display never fails a launch
            pass
