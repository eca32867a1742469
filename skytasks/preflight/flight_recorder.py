"""NCCL's flight recorder, read for a hang: which rank never entered the collective the others wait in.

With `TORCH_FR_BUFFER_SIZE` set on the ranks, each NCCL process group keeps its last collectives
(`collective_seq_id`, `profiling_name` such as "nccl:all_reduce", `state`). A rank's dump
(`dump`, on the rank, before it is stopped) is torch's own pickle; `never_joined` compares the
ranks' dumps as PyTorch's `fr_trace` analysis does ("Not all ranks joining collective N ... missing
ranks: {1}"), as a pure function of plain dicts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
DEFAULT_BUFFER = "2000"  # entries per rank: enough for the collectives of the last steps


@dataclass(frozen=True)
class NotJoined:
    """In `group`, collective `seq` (`name`) was entered by `entered` and never by `missing`."""

    group: str
    seq: int
    name: str
    entered: tuple[int, ...]
    missing: tuple[int, ...]

    def text(self) -> str:
        return (f"flight recorder: collective #{self.seq} ({self.name}) of process group {self.group} was entered "
                f"by ranks {list(self.entered)}; ranks {list(self.missing)} never joined it")


def dump(path: str) -> bool:
    """This rank's flight recorder to `path` (torch's pickle); False when there is none."""
    try:
        import torch._C._distributed_c10d as c10d

        # NCCL's own recorder where torch was built with it, else the CPU one (gloo: torch 2.13 has it)
        trace = getattr(c10d, "_dump_nccl_trace", None) or getattr(c10d, "_dump_fr_trace")
        data = trace(True, False, False)  # includeCollectives, includeStackTraces, onlyActive
    except (ImportError, AttributeError, RuntimeError, TypeError):
        return False
    with open(path, "wb") as out:
        out.write(data)
    return True


def never_joined(dumps: Mapping[int, Mapping[str, Any]]) -> list[NotJoined]:
    """Each process group's newest collective that some rank entered and others did not, from
    every rank's dump (rank -> torch's unpickled dict, its "entries"). A rank whose dump is
    missing is no evidence either way: it is left out."""
    newest: dict[str, dict[int, tuple[int, str]]] = {}  # group -> rank -> (newest seq entered, its name)
    for rank, trace in dumps.items():
        for entry in trace.get("entries", []):
            seq = int(entry.get("collective_seq_id") or 0)
            if seq <= 0:
                continue  # a point-to-point op: no collective sequence
            group = str(entry.get("pg_id", entry.get("process_group", ("?",))[0]))
            known = newest.setdefault(group, {})
            if seq > known.get(rank, (0, ""))[0]:
                known[rank] = (seq, str(entry.get("profiling_name", "?")))
    found = []
    for group, ranks in sorted(newest.items()):
        top = max(seq for seq, _ in ranks.values())
        behind = tuple(sorted(r for r, (seq, _) in ranks.items() if seq < top))
        if behind:
            entered = tuple(sorted(r for r, (seq, _) in ranks.items() if seq == top))
            found.append(NotJoined(group, top, ranks[entered[0]][1], entered, behind))
    return found
