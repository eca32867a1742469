"""skytasks.report(**metrics): training metrics from a rank to the caller, live.

Called on the head it updates the call's live metrics artifact in the Prefect UI (and prints
outside a flow). Other ranks are a no-op unless they pass `all_ranks=True`, so the usual
`report(epoch=e, loss=l)` in every rank's loop sends one row, not one per rank.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from skytasks.protocol import Op, message
from skytasks.rank import rank_info

_channel: Any = None  # the rank's FrameWriter, set by skytasks.node.worker


def _plain(value: Any) -> Any:
    """Numbers, strings and bools travel; tensors and numpy scalars become Python numbers."""
    if hasattr(value, "item") and callable(value.item):
        try:
            value = value.item()
        except (ValueError, RuntimeError):
            pass
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, numbers.Real):
        value = float(value) if not isinstance(value, numbers.Integral) else int(value)
        return None if isinstance(value, float) and math.isnan(value) else value
    return str(value)


def report(*, all_ranks: bool = False, **metrics: Any) -> None:
    """Live metrics of the call, from inside a rank: a row in the call's Prefect artifact, updated
    in place (printed outside a flow). Only the head's calls count unless `all_ranks=True`.
    Numbers, strings and tensors of one value travel. A position and its total (`epoch`/`epochs`,
    `step`/`steps` or `total_steps`, `iteration`/`iterations`, `batch`/`batches`), or `progress`
    alone (a fraction, or a percentage above 1), also drive the call's progress bar.

        report(epoch=epoch, epochs=10, loss=loss.item())
    """
    info = rank_info()  # raises the clear outside-a-rank error
    if not (info.is_head or all_ranks):
        return
    if not metrics:
        raise TypeError("report: give at least one metric, e.g. report(epoch=1, loss=0.5)")
    if _channel is None:
        raise RuntimeError("report: this rank has no channel to the controller")
    _channel.send(message(Op.REPORT, metrics={k: _plain(v) for k, v in metrics.items()}))


# Position and total pairs a `report` may carry; the first pair present drives the call's progress
# bar in the Prefect UI: report(epoch=3, epochs=10) is 30%. `progress` alone is a fraction (0-1)
# or a percentage (above 1).
PROGRESS_PAIRS = (("epoch", "epochs"), ("step", "total_steps"), ("step", "steps"), ("iteration", "iterations"),
                  ("batch", "batches"))


def progress_percent(metrics: dict[str, Any]) -> float | None:
    """How far the call is, in percent, from one report; None when it does not say."""
    for position, total in PROGRESS_PAIRS:
        at, of = _number(metrics.get(position)), _number(metrics.get(total))
        if at is not None and of is not None and of > 0:
            return max(0.0, min(100.0, 100.0 * at / of))
    progress = _number(metrics.get("progress"))
    if progress is not None:
        return max(0.0, min(100.0, progress * 100 if progress <= 1 else progress))
    return None


def _number(value: Any) -> float | None:
    """A finite int or float as a float (never a bool); None for anything else."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None
