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
REQUEST_OP = "flight_recorder"  # agent -> rank, on its control channel: write `summary()` to msg["path"]
KEPT_ENTRIES = 64  # a rank's newest entries sent back: the hang is among the last, not the first


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


def summary() -> dict[str, Any]:
    """This rank's newest recorded collectives, only the fields `never_joined` reads (JSON-able):
    what a rank sends back before it is stopped for a hang. Empty where nothing was recorded."""
    import pickle
    import sys

    if "torch.distributed" not in sys.modules:
        return {}  # no collective was ever entered here: not worth importing torch for at a stop
    try:
        import torch._C._distributed_c10d as c10d

        trace = getattr(c10d, "_dump_nccl_trace", None) or getattr(c10d, "_dump_fr_trace")
        # the dump is torch's own pickle, read in the process that wrote it
        entries = pickle.loads(trace(True, False, False)).get("entries", [])
    except (ImportError, AttributeError, RuntimeError, TypeError, pickle.UnpicklingError):
        return {}
    return {"entries": [{"collective_seq_id": e.get("collective_seq_id"), "pg_id": e.get("pg_id"),
                         "profiling_name": e.get("profiling_name")} for e in entries[-KEPT_ENTRIES:]]}


def records_of(stopped: Mapping[str, Any]) -> dict[int, dict[str, Any]]:
    """The summaries in a node's STOPPED message (rank -> JSON text). Evidence only: one that does
    not read is left out, never an error."""
    import json

    found = {}
    for rank, text in (stopped.get("flight_recorder") or {}).items():
        try:
            found[int(rank)] = dict(json.loads(text))
        except (ValueError, TypeError):
            pass
    return found


def hang_evidence(dumps: Mapping[int, Mapping[str, Any]]) -> str:
    """What the flight recorder says of a hang, for the HangError: each collective some ranks never
    joined; empty when the ranks' records show none (or there are none)."""
    return "; ".join(found.text() for found in never_joined(dumps))


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
