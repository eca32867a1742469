"""Which Kubernetes nodes hold the GPU product a pool asks for (`accelerator`), as node labels say it.

One rule, used by the pods' node affinity and by `skytasks check`: a label value names the
accelerator when every token of the accelerator is among the value's tokens. Tokens are the runs
of letters and digits, case-insensitive; the vendor words "nvidia" and "tesla" name no product and
are dropped from the accelerator. So "A10" never names an A100 node, "L4" never an L40S, and
"H100" names GFD's `NVIDIA-H100-80GB-HBM3` and GKE's `nvidia-h100-80gb`. A value that says the
node offers part of a GPU (GFD's `-MIG-<profile>` slices, `-SHARED` time-sliced GPUs) names the
accelerator only when the accelerator says so too ("A100-MIG-1g.5gb").

The pods must require the product even where no node carries it yet (a node pool scaled to zero,
or a pool that may not list nodes), because the label is what a node autoscaler builds the new
node from. A required node affinity term takes exact values, so the values that name each known
product are listed here, per label, as the projects that set them spell them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

GFD = "nvidia.com/gpu.product"  # NVIDIA GPU Feature Discovery (and the GPU operator): NVML's name, spaces as '-'
GKE = "cloud.google.com/gke-accelerator"  # GKE: the node pool's accelerator type
KARPENTER = "karpenter.k8s.aws/instance-gpu-name"  # Karpenter on AWS: EC2's GPU name, lower-case
KARPENTER_MEMORY = "karpenter.k8s.aws/instance-gpu-memory"  # MiB per GPU: tells an A100 40GB from an 80GB
# Labels an autoscaler builds nodes from, then labels only read off the nodes that carry them
# (CoreWeave's class, and the plain `accelerator` some clusters set by hand).
AUTOSCALER_LABELS = (GFD, GKE, KARPENTER)
SEEN_ONLY_LABELS = ("gpu.nvidia.com/class", "accelerator")

_NOISE = frozenset({"nvidia", "tesla"})
_PART_OF_A_GPU = frozenset({"mig", "shared"})
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


@dataclass(frozen=True)
class Known:
    """A label value a project sets, `words` for what it means beyond its own spelling (GKE's
    `nvidia-tesla-a100` is the 40GB card), and `also`: label=value pairs a node carries that
    make this meaning exact (Karpenter names an A100 "a100" whatever its memory)."""

    value: str
    words: str = ""
    also: tuple[tuple[str, str], ...] = ()


def _karpenter(name: str, mib: int, words: str = "") -> Known:
    return Known(name, words, ((KARPENTER_MEMORY, str(mib)),))


KNOWN: dict[str, tuple[Known, ...]] = {
    # NVML product names as GFD writes them (k8s-device-plugin v0.20.0, internal/lm/resource.go).
    GFD: (Known("NVIDIA-H100-80GB-HBM3", "sxm sxm5"), Known("NVIDIA-H100-PCIe", "80gb"), Known("NVIDIA-H100-NVL", "94gb"),
          Known("NVIDIA-H200", "141gb sxm"), Known("NVIDIA-H200-NVL", "141gb"), Known("NVIDIA-GH200-480GB"),
          Known("NVIDIA-B200"), Known("NVIDIA-A100-SXM4-80GB"), Known("NVIDIA-A100-SXM4-40GB"),
          Known("NVIDIA-A100-PCIE-40GB"), Known("NVIDIA-A100-80GB-PCIe"), Known("NVIDIA-A10G", "24gb"),
          Known("NVIDIA-A10", "24gb"), Known("NVIDIA-A30", "24gb"), Known("NVIDIA-A40", "48gb"),
          Known("NVIDIA-L4", "24gb"), Known("NVIDIA-L40", "48gb"), Known("NVIDIA-L40S", "48gb"),
          Known("Tesla-T4", "16gb"), Known("Tesla-V100-SXM2-16GB"), Known("Tesla-V100-SXM2-32GB"),
          Known("Tesla-V100-PCIE-16GB"), Known("Tesla-V100-PCIE-32GB"), Known("Tesla-P100-PCIE-16GB"),
          Known("Tesla-P4", "8gb"), Known("NVIDIA-RTX-A6000", "48gb")),
    # GKE's accelerator types (docs: "Run GPUs in GKE Standard node pools").
    GKE: (Known("nvidia-h100-80gb", "sxm sxm5"), Known("nvidia-h100-mega-80gb", "sxm sxm5"),
          Known("nvidia-h200-141gb", "sxm"), Known("nvidia-b200"), Known("nvidia-tesla-a100", "40gb sxm sxm4"),
          Known("nvidia-a100-80gb", "sxm sxm4"), Known("nvidia-l4", "24gb"), Known("nvidia-tesla-t4", "16gb"),
          Known("nvidia-tesla-v100", "16gb"), Known("nvidia-tesla-p100", "16gb"), Known("nvidia-tesla-p4", "8gb"),
          Known("nvidia-rtx-pro-6000")),
    # Karpenter's instance-gpu-name with its instance-gpu-memory (karpenter-provider-aws v1.14 docs,
    # instance-types.md; p3 from v1.0's).
    KARPENTER: (_karpenter("a100", 40960, "40gb sxm sxm4"), _karpenter("a100", 81920, "80gb sxm sxm4"),
                _karpenter("h100", 81920, "80gb sxm sxm5"), _karpenter("h200", 144384, "141gb sxm"),
                _karpenter("b200", 183359), _karpenter("b300", 275040), _karpenter("a10g", 22888, "24gb"),
                _karpenter("l4", 22888, "24gb"), _karpenter("l40s", 45776, "48gb"), _karpenter("t4", 16384, "16gb"),
                _karpenter("t4g", 16384, "16gb"), _karpenter("v100", 16384, "16gb"),
                _karpenter("v100", 32768, "32gb")),
}


def tokens(text: str) -> frozenset[str]:
    return frozenset(t for t in re.split(r"[^a-z0-9]+", text.lower()) if t)


def names(accelerator: str, value: str, words: str = "") -> bool:
    """Whether a label value (with what it is known to mean) names the accelerator."""
    want = tokens(accelerator) - _NOISE
    have = tokens(value) | tokens(words)
    return bool(want) and want <= have and not (have & _PART_OF_A_GPU) - want


def seen_products(accelerator: str, node_labels: Iterable[Mapping[str, str]],
                  labels: Iterable[str] = AUTOSCALER_LABELS + SEEN_ONLY_LABELS) -> dict[str, list[str]]:
    """The values of each label that the cluster's nodes carry and that name the accelerator."""
    nodes = [dict(n) for n in node_labels]
    out = {}
    for label in labels:
        found = sorted({n[label] for n in nodes if label in n and names(accelerator, n[label], _words(label, n[label]))})
        if found:
            out[label] = found
    return out


def _words(label: str, value: str) -> str:
    """What a known value means, where all its entries agree (Karpenter's "a100" does not say its memory)."""
    entries = [k for k in KNOWN.get(label, ()) if k.value == value]
    return entries[0].words if len(entries) == 1 else ""


def _as_written(label: str, accelerator: str) -> list[str]:
    """The accelerator as the user spelled it, and as each project would: the pods then ask for a
    product the table does not know yet, where a node of it comes up."""
    spelled = "-".join(accelerator.split())
    upper, lower = spelled.upper(), spelled.lower()
    variants = {
        GFD: [spelled, upper, upper if upper.startswith("NVIDIA-") else "NVIDIA-" + upper],
        GKE: [lower if lower.startswith("nvidia-") else "nvidia-" + lower],
        KARPENTER: [lower],
    }.get(label, [spelled])
    return [v for v in variants if len(v) <= 63 and _LABEL_VALUE.match(v) and names(accelerator, v)]


def _expression(key: str, values: Iterable[str]) -> dict[str, Any]:
    return {"key": key, "operator": "In", "values": sorted(set(values))}


def _label_terms(label: str, accelerator: str, seen: Iterable[str]) -> list[dict[str, Any]]:
    plain = set(seen) | set(_as_written(label, accelerator))
    narrowed: dict[str, dict[str, set[str]]] = {}
    entries = KNOWN.get(label, ())
    for value in dict.fromkeys(k.value for k in entries):
        same = [k for k in entries if k.value == value]
        hits = [k for k in same if names(accelerator, k.value, k.words)]
        if hits and (len(hits) == len(same) or not any(k.also for k in hits)):
            plain.add(value)
        elif hits:  # only some meanings of this value: require what tells them apart
            for k in hits:
                for key, v in k.also:
                    narrowed.setdefault(value, {}).setdefault(key, set()).add(v)
    terms = [{"matchExpressions": [_expression(label, plain)]}] if plain else []
    for value, also in narrowed.items():
        if value not in plain:
            terms.append({"matchExpressions": [_expression(label, [value])] +
                          [_expression(key, vs) for key, vs in sorted(also.items())]})
    return terms


def node_terms(accelerator: str, node_labels: Optional[Iterable[Mapping[str, str]]] = None,
               gpu_label: Optional[str] = None) -> list[dict[str, Any]]:
    """The nodeSelectorTerms (ORed) of the nodes that hold `accelerator`: per product label, the
    known values that name it, its own spelling, and the values seen on the cluster's nodes
    (`node_labels`, when the pool could read them) that name it. With `gpu_label` (the
    cluster's own product label), that label alone."""
    labels = (gpu_label,) if gpu_label else AUTOSCALER_LABELS + SEEN_ONLY_LABELS
    seen = seen_products(accelerator, node_labels or (), labels)
    terms: list[dict[str, Any]] = []
    for label in labels:
        if gpu_label or label in AUTOSCALER_LABELS or label in seen:
            terms += _label_terms(label, accelerator, seen.get(label, ()))
    return terms


def _holds(expression: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    if expression["operator"] != "In":
        raise ValueError(f"only In expressions are made here, not {expression['operator']}")
    return labels.get(expression["key"]) in expression["values"]


def node_matches(terms: Iterable[Mapping[str, Any]], labels: Mapping[str, str]) -> bool:
    """Whether a node with these labels satisfies any of the terms, as the scheduler reads them."""
    return any(term.get("matchExpressions") and all(_holds(e, labels) for e in term["matchExpressions"])
               for term in terms)
