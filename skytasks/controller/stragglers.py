"""Some ranks returned while others still run: say so, without failing the call.

A user's loop that ends by wall clock on one rank while its peer waits in `all_reduce` would
leave the call waiting in silence, forever by default. After `after` seconds with ranks returned
and ranks still running, the call reads the running ranks' stacks (without stopping them) and
gives one WARNING naming each one and where it is, and how `hang_timeout_seconds` would end it.
"""

from __future__ import annotations

from skytasks.controller.stack_groups import group_by_place
from skytasks.stacks import rank_ranges, user_frame, where

PROBE_SECONDS = 2.0  # how long the running ranks' stacks are waited for


class StragglerWatch:
    def __init__(self, after: float | None):
        self.after = after  # None or 0: never warn
        self._warn_at: float | None = None
        self._probe_until: float | None = None
        self.wanted: set[int] = set()
        self.stacks: dict[int, str] = {}
        self.warned = False

    def wake_at(self) -> float | None:
        return self._probe_until if self._probe_until is not None else self._warn_at

    @property
    def armed(self) -> bool:
        """Waiting for a return to start the clock (a call asks only then who still runs: once,
        not at each of 1,024 returns)."""
        return bool(self.after) and self._warn_at is None and not self.warned

    def rank_returned(self, now: float, still_running: set[int]) -> None:
        """The clock starts at the first return that leaves ranks running."""
        if still_running and self.armed:
            self._warn_at = now + self.after  # type: ignore[operator]

    def due(self, now: float) -> bool:
        return self._warn_at is not None and self._probe_until is None and now >= self._warn_at

    def probe(self, running: set[int], now: float) -> None:
        self.wanted, self.stacks = set(running), {}
        self._probe_until = now + PROBE_SECONDS

    @property
    def probing(self) -> bool:
        return self._probe_until is not None

    def add_stack(self, rank: int, stack: str) -> bool:
        """A running rank's stack; True when every wanted one is in."""
        if rank in self.wanted and stack:
            self.stacks[rank] = stack
        return not self.wanted - set(self.stacks)

    def probe_over(self, now: float) -> bool:
        return self._probe_until is not None and now >= self._probe_until

    def warning(self, returned: list[int], running: set[int]) -> str:
        """The one line, once: then the watch is done for this call."""
        self.warned, self._warn_at, self._probe_until = True, None, None
        at = {rank: user_frame(self.stacks.get(rank, "")) or where(self.stacks.get(rank, "")) or "somewhere unreadable"
              for rank in running}
        places = [f"rank {ranks[0]} in {place}" if len(ranks) == 1 else
                  f"ranks {rank_ranges(ranks)} ({len(ranks):,}) in {place}"
                  for place, ranks in group_by_place(at)]  # ranks in one place share one entry
        shown = _ranks(returned)
        return (f"{len(running)} rank(s) still running {self.after:g}s after {shown} returned: "
                f"{'; '.join(places)}. The call waits for every rank; set hang_timeout_seconds to end a call "
                f"whose ranks make no progress")


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {rank_ranges(ranks)}"
