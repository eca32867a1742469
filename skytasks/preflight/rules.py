"""What the preflight decides, as pure functions over typed figures: tested without a process.

A rank's probe returns its figures (`RankFigures`); the controller folds each node's into one
`NodeFigures` (the node is as good as its worst rank, and as good as its best link: a pairwise test
names the bad node, since every pair that includes it is slow and the others are not), and
`judge` compares them with what the pool promised and with each other: a `Verdict` naming every
unhealthy node with the check, its figure, the threshold and the unit.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional, Sequence

FREE_MEMORY_SHARE = 0.8  # a GPU with less of its memory free is held by something else (a stray process)


@dataclass(frozen=True)
class RankFigures:
    """What one rank measured (the probe's return value)."""

    rank: int
    node_rank: int
    gpus: int = 0  # GPUs the rank's node shows it
    cuda: bool = False  # CUDA works in the rank (a driver, a device)
    product: str = ""  # its GPU's name
    free_share: Optional[float] = None  # its GPU's free memory over its total
    allreduce_seconds: Optional[float] = None  # the small all-reduce over every rank; None: no process group
    compute: Optional[float] = None  # "full": matmul, in `compute_unit`
    compute_unit: str = "GFLOPS"  # TFLOPS on GPU
    intra_gbps: Optional[float] = None  # "full": all-reduce within its node (local rank 0 only)
    pair_gbps: Mapping[int, float] = field(default_factory=dict)  # "full": other node -> all-reduce GB/s
    dcgm: Optional[str] = None  # "pass", or what DCGM's quick diagnostic said; None: not run

    @classmethod
    def from_probe(cls, value: Mapping[str, Any]) -> RankFigures:
        known = {k: v for k, v in value.items() if k in cls.__dataclass_fields__}
        known["pair_gbps"] = {int(k): float(v) for k, v in dict(value.get("pair_gbps") or {}).items()}
        return cls(**known)


@dataclass(frozen=True)
class NodeFigures:
    """One node's figures: its worst rank's (on CPU, its ranks' together), and its best link's."""

    node: int
    address: str
    answered: bool = True  # every rank of it started and ran the probe
    problem: str = ""  # why not: the error its ranks gave, or that they never answered
    gpus: int = 0
    cuda: bool = False  # CUDA works in every rank of it
    product: str = ""
    free_share: Optional[float] = None
    compute: Optional[float] = None
    compute_unit: str = "GFLOPS"
    intra_gbps: Optional[float] = None
    pair_gbps: Optional[float] = None
    dcgm: Optional[str] = None


def one_figure_per_link(ranks: Sequence[RankFigures]) -> list[RankFigures]:
    """Both ends of a pair time the same all-reduce, each on its own clock (the later to enter
    waits less): the link's figure is the slower end's, so that both nodes show the one link alike."""
    seen: dict[tuple[int, int], float] = {}
    for r in ranks:
        for other, gbps in r.pair_gbps.items():
            seen[(r.node_rank, other)] = min(gbps, seen.get((r.node_rank, other), gbps))
    return [replace(r, pair_gbps={other: min(g, seen.get((other, r.node_rank), g)) for other, g in r.pair_gbps.items()})
            if r.pair_gbps else r for r in ranks]


def fold(node: int, address: str, ranks: Sequence[RankFigures]) -> NodeFigures:
    """A node's figures from its ranks' (all of which answered)."""
    compute = [r.compute for r in ranks if r.compute is not None]
    free = [r.free_share for r in ranks if r.free_share is not None]
    intra = [r.intra_gbps for r in ranks if r.intra_gbps is not None]
    pairs = [g for r in ranks for g in r.pair_gbps.values()]
    dcgm = next((r.dcgm for r in ranks if r.dcgm not in (None, "pass")), next((r.dcgm for r in ranks if r.dcgm), None))
    first = ranks[0] if ranks else RankFigures(-1, node)
    # A GPU node is as good as its worst GPU; a CPU node's ranks share its cores, so its figure is
    # what they do together (how the scheduler split the cores between them is no fault of it).
    together = sum(compute) if first.compute_unit == "GFLOPS" else min(compute, default=0.0)
    return NodeFigures(node, address, gpus=max((r.gpus for r in ranks), default=0),
                       cuda=bool(ranks) and all(r.cuda for r in ranks), product=first.product,
                       free_share=min(free) if free else None, compute=together if compute else None,
                       compute_unit=first.compute_unit, intra_gbps=min(intra) if intra else None,
                       pair_gbps=max(pairs) if pairs else None, dcgm=dcgm)


@dataclass(frozen=True)
class Rules:
    """What the pool promised, and the thresholds of "full"."""

    level: str = "basic"
    accelerator: Optional[str] = None
    accelerators_per_node: Optional[int] = None
    min_ratio: float = 0.5
    min_tflops: Optional[float] = None
    min_gbps: Optional[float] = None
    timeout_seconds: float = 60.0


@dataclass(frozen=True)
class Finding:
    """One reason a node is unhealthy."""

    node: int
    address: str
    check: str  # "collective", "gpus", "product", "free_memory", "compute", "intra_bandwidth", "pair_bandwidth", "dcgm"
    figure: Optional[float]
    threshold: Optional[float]
    unit: str
    detail: str = ""

    def text(self) -> str:
        return f"node {self.node} ({self.address}) failed the {self.check} check{measured(self)}"


def number(x: float) -> str:
    """Three significant figures, as a person reads them: 0.676, 96.7, 5000, 0.00005 (never in
    e-notation, which .3g uses from 999.5 up and under 0.0001)."""
    text = f"{x:.3g}"
    if "e" not in text:
        return text
    if abs(x) >= 1:
        return f"{x:.0f}"
    return f"{x:.{2 - math.floor(math.log10(abs(x)))}f}"  # three figures after the leading zeros


def spread(nodes: Sequence["NodeFigures"]) -> str:
    """'compute 79.1-95.7 GFLOPS, intra-node 1.2 GB/s, pair 0.825-0.858 GB/s': each figure's range
    over the nodes that have it, for the healthy line (the table is the artifact's); '' on basic."""
    parts = []
    for label, figure_of, unit in (("compute", lambda n: n.compute, nodes[0].compute_unit if nodes else ""),
                                   ("intra-node", lambda n: n.intra_gbps, "GB/s"),
                                   ("pair", lambda n: n.pair_gbps, "GB/s")):
        values = [v for v in map(figure_of, nodes) if v is not None]
        if values:
            low, high = number(min(values)), number(max(values))
            parts.append(f"{label} {low} {unit}" if low == high else f"{label} {low}-{high} {unit}")
    return ", ".join(parts)


def measured(finding: Any) -> str:
    """': 1.15 GFLOPS (threshold 45.7 GFLOPS); detail', as far as `finding` (a Finding or the event
    made from one) has each part: said alike in the PoolStartError, the log and the event."""
    figure = "" if finding.figure is None else f": {number(finding.figure)} {finding.unit}"
    floor = "" if finding.threshold is None else f" (threshold {number(finding.threshold)} {finding.unit})"
    why = f"; {finding.detail}" if finding.detail else ""
    return figure + floor + why


@dataclass(frozen=True)
class Verdict:
    nodes: tuple[NodeFigures, ...]
    findings: tuple[Finding, ...]

    @property
    def unhealthy(self) -> tuple[int, ...]:
        return tuple(sorted({f.node for f in self.findings}))

    @property
    def healthy(self) -> bool:
        return not self.findings

    def rows(self) -> list[dict[str, Any]]:
        """The artifact's table: a row per node, each check's figure, and the verdict."""
        bad = {n: [f for f in self.findings if f.node == n] for n in self.unhealthy}
        rows = []
        for n in self.nodes:
            unit = n.compute_unit
            rows.append({"node": n.node, "address": n.address, "gpus": n.gpus, "product": n.product or None,
                         "free memory %": None if n.free_share is None else round(100 * n.free_share, 1),
                         f"compute {unit}": _round(n.compute), "intra-node GB/s": _round(n.intra_gbps),
                         "pair GB/s": _round(n.pair_gbps), "dcgm": n.dcgm,
                         "verdict": "; ".join(f.text() for f in bad[n.node]) if n.node in bad else "healthy"})
        return rows


def _round(value: Optional[float]) -> Optional[float]:
    return None if value is None else float(f"{value:.4g}")


def judge(nodes: Sequence[NodeFigures], rules: Rules) -> Verdict:
    """Every node against what the pool promised, and (for "full") against the pool's median."""
    findings = [Finding(n.node, n.address, "collective", None, rules.timeout_seconds, "s", n.problem)
                for n in nodes if not n.answered]
    answered = [n for n in nodes if n.answered]
    # The GPUs the pool promised are checked where CUDA works: a node without it among nodes with
    # it is unhealthy (a driver gone); where no node has it (GPUs that are only a scheduler's
    # resource, a CPU stand-in) there is nothing to hold a node to.
    if any(n.cuda for n in answered):
        for n in answered:
            findings += _promised(n, rules) if n.cuda else [
                Finding(n.node, n.address, "gpus", 0.0, float(rules.accelerators_per_node or 1), "GPUs",
                        "CUDA does not work in its ranks, as it does on the pool's other nodes")]
    if rules.level == "full":
        floor_compute = rules.min_tflops
        for check, figure_of, unit_of, floor in (
                ("compute", lambda n: n.compute, lambda n: n.compute_unit, floor_compute),
                ("intra_bandwidth", lambda n: n.intra_gbps, lambda n: "GB/s", rules.min_gbps),
                ("pair_bandwidth", lambda n: n.pair_gbps, lambda n: "GB/s", rules.min_gbps)):
            findings += _compared(answered, check, figure_of, unit_of, floor, rules.min_ratio)
        findings += [Finding(n.node, n.address, "dcgm", None, None, "", n.dcgm)
                     for n in answered if n.dcgm not in (None, "pass")]
    return Verdict(tuple(nodes), tuple(findings))


def _promised(n: NodeFigures, rules: Rules) -> list[Finding]:
    found = []
    if rules.accelerators_per_node and n.gpus < rules.accelerators_per_node:
        found.append(Finding(n.node, n.address, "gpus", float(n.gpus), float(rules.accelerators_per_node), "GPUs"))
    if rules.accelerator and n.gpus and not product_matches(rules.accelerator, n.product):
        found.append(Finding(n.node, n.address, "product", None, None, "",
                             f"its GPU is {n.product!r}, the pool asked for {rules.accelerator!r}"))
    if n.free_share is not None and n.free_share < FREE_MEMORY_SHARE:
        found.append(Finding(n.node, n.address, "free_memory", 100 * n.free_share, 100 * FREE_MEMORY_SHARE, "%",
                             "something else holds its GPU memory"))
    return found


def product_matches(asked: str, product: str) -> bool:
    """`accelerator` against the GPU's name, token by token ("A10" is not an "A100")."""
    tokens = product.upper().replace("-", " ").replace("_", " ").split()
    return all(part in tokens for part in asked.upper().replace("-", " ").split())


def _compared(nodes: Sequence[NodeFigures], check: str, figure_of: Any, unit_of: Any, floor: Optional[float],
              min_ratio: float) -> list[Finding]:
    figures = [(n, figure_of(n)) for n in nodes if figure_of(n) is not None]
    if not figures:
        return []
    median = statistics.median(f for _, f in figures)
    found = []
    for n, figure in figures:
        unit = unit_of(n)
        # The user's floor in TFLOPS holds a CPU rank's GFLOPS too.
        scaled = None if floor is None else floor * (1000 if check == "compute" and unit == "GFLOPS" else 1)
        if scaled is not None and figure < scaled:
            name = "preflight_min_tflops" if check == "compute" else "preflight_min_gbps"
            found.append(Finding(n.node, n.address, check, figure, scaled, unit, f"below the floor {name}"))
        elif figure < min_ratio * median:
            found.append(Finding(n.node, n.address, check, figure, min_ratio * median, unit,
                                 f"below {min_ratio:g} of the pool's median {number(median)} {unit}"))
    return found


# -- what to do about unhealthy nodes ----------------------------------------------------------

@dataclass(frozen=True)
class NodesAction:
    nodes: tuple[int, ...]  # the unhealthy nodes, by node rank


class DropNodes(NodesAction):
    """An elastic pool goes on without them (it still has at least min_nodes)."""


class ReplaceNodes(NodesAction):
    """New nodes in their place (the provider ends these and avoids their machines)."""


@dataclass(frozen=True)
class FailStart:
    """The pool cannot be made healthy: PoolStartError with this text."""

    reason: str


def plan(verdict: Verdict, *, nodes: int, fewest: int, replaces_elsewhere: bool,
         replacements_left: int) -> DropNodes | ReplaceNodes | FailStart:
    """An elastic pool drops what it can spare; the rest is replaced where the provider gets
    another machine (never on ssh: the same host again), from at most `replacements_left`."""
    bad = verdict.unhealthy
    if nodes - len(bad) >= fewest and fewest < nodes:
        return DropNodes(bad)
    short = len(bad) if fewest >= nodes else fewest - (nodes - len(bad))
    named = "; ".join(f.text() for f in verdict.findings)
    if not replaces_elsewhere:
        return FailStart(f"the pool cannot be made healthy: {named} (its provider has no other machine to take; "
                         f"{nodes - len(bad)} healthy node(s), fewer than the {fewest} it needs)")
    if short > replacements_left:
        return FailStart(f"the pool cannot be made healthy: {named} (no replacements left: node_recoveries "
                         f"allows {replacements_left} more per start)")
    return ReplaceNodes(bad)
