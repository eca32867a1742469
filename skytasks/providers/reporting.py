"""The old path of the pool event bus, kept for code that imports it from here: the bus is
`skytasks.event_bus` (it belongs to no provider; the controller and the Prefect side use it too)."""

from skytasks.event_bus import (EVENT_HOLDER, PoolReporter, add_sink, console_logger, flow_run_id, logger,
                                publish)

__all__ = ["EVENT_HOLDER", "PoolReporter", "add_sink", "console_logger", "flow_run_id", "logger", "publish"]
