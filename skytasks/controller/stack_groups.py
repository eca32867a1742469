"""Ranks that stand in the same place share one line: failure reports that fit one screen.

At 1,024 ranks a failure stops 1,023 ranks, nearly all in the same collective. Printed one by
one, that would be thousands of lines of the same frames. Here they are grouped by where they are
(`stacks.where`): "1,023 ranks in `all_reduce` (train.py:42) (ranks 0-16, 18-1023)". Each
rank's whole stack still goes to its own (or its node's) task-run log.
"""

from __future__ import annotations

from collections.abc import Mapping

from skytasks.stacks import rank_ranges, where


def group_by_place(places: Mapping[int, str]) -> list[tuple[str, list[int]]]:
    """rank -> place, to (place, its ranks): the most crowded place first, then by first rank."""
    groups: dict[str, list[int]] = {}
    for rank in sorted(places):
        groups.setdefault(places[rank], []).append(rank)
    return sorted(groups.items(), key=lambda g: (-len(g[1]), g[1][0]))


def stack_lines(stacks: Mapping[int, str], why: str) -> list[str]:
    """One line per place: "[rank 3] was in ..." for a rank alone there, else a count and ranges."""
    places = {rank: where(stack) or "somewhere unreadable" for rank, stack in stacks.items()}
    return [place_line(ranks, f"was {place}", f"were {place}", why) for place, ranks in group_by_place(places)]


def place_line(ranks: list[int], one: str, many: str, why: str) -> str:
    tail = f" ({why})" if why else ""
    if len(ranks) == 1:
        return f"[rank {ranks[0]}] {one}{tail}"
    return f"[{len(ranks):,} ranks] {many}{tail}: ranks {rank_ranges(ranks)}"
