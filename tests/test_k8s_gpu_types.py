"""GPU product matching for kubernetes pools, without a cluster: which label values name an
accelerator (token by token), and the node affinity terms the pods require, with and without the
cluster's nodes, as the scheduler would read them."""

from __future__ import annotations

import pytest

from skytasks.providers.kubernetes import gpu_types as g
from skytasks.providers.kubernetes.gpu_types import GFD, GKE, KARPENTER, KARPENTER_MEMORY

EVERY_KNOWN_NODE = [{label: k.value, **dict(k.also)} for label, known in g.KNOWN.items() for k in known]


@pytest.mark.parametrize("accelerator, value, named", [
    ("H100", "NVIDIA-H100-80GB-HBM3", True),
    ("H100", "nvidia-h100-80gb", True),
    ("H100", "nvidia-h100-mega-80gb", True),
    ("h100", "h100", True),
    ("H100", "NVIDIA-GH200-480GB", False),
    ("H100", "NVIDIA-H200", False),
    ("A10", "NVIDIA-A100-SXM4-40GB", False),
    ("A10", "nvidia-tesla-a100", False),
    ("A10", "NVIDIA-A10", True),
    ("A10", "NVIDIA-A10G", False),
    ("L4", "NVIDIA-L40S", False),
    ("L4", "NVIDIA-L40", False),
    ("L4", "NVIDIA-L4", True),
    ("A100-80GB", "NVIDIA-A100-SXM4-80GB", True),
    ("A100-80GB", "NVIDIA-A100-80GB-PCIe", True),
    ("A100-80GB", "NVIDIA-A100-SXM4-40GB", False),
    ("A100-80GB", "nvidia-tesla-a100", False),
    ("A100 SXM4", "NVIDIA-A100-SXM4-80GB", True),
    ("A100 SXM4", "NVIDIA-A100-80GB-PCIe", False),
    ("T4", "Tesla-T4", True),
    ("Tesla-T4", "nvidia-tesla-t4", True),
    ("T4", "t4g", False),
    ("nvidia-h100-80gb", "h100", False),  # "80gb" is not in Karpenter's name: its memory label says that
    ("nvidia", "NVIDIA-H100-80GB-HBM3", False),  # the vendor alone names no product
    ("", "NVIDIA-L4", False),
    # A slice or a shared GPU is not the GPU: only when the accelerator says so.
    ("A100", "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb", False),
    ("A100-MIG-1g.5gb", "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb", True),
    ("A100-MIG-1g.5gb", "NVIDIA-A100-SXM4-40GB-MIG-2g.10gb", False),
    ("T4", "Tesla-T4-SHARED", False),
    ("T4-shared", "Tesla-T4-SHARED", True),
])
def test_a_value_names_the_accelerator_token_by_token(accelerator, value, named):
    assert g.names(accelerator, value) is named


def test_what_a_known_value_means_beyond_its_spelling():
    # GKE's nvidia-tesla-a100 is the 40GB card; GFD's NVIDIA-H200 the 141GB one.
    assert g.names("A100-40GB", "nvidia-tesla-a100", "40gb sxm sxm4")
    assert not g.names("A100-80GB", "nvidia-tesla-a100", "40gb sxm sxm4")


def scheduled(terms, nodes):
    return [n for n in nodes if g.node_matches(terms, n)]


@pytest.mark.parametrize("accelerator, may, never", [
    ("H100", [{GFD: "NVIDIA-H100-80GB-HBM3"}, {GKE: "nvidia-h100-80gb"}, {GKE: "nvidia-h100-mega-80gb"},
              {KARPENTER: "h100", KARPENTER_MEMORY: "81920"}, {GFD: "NVIDIA-H100-PCIe"}],
     [{GFD: "NVIDIA-GH200-480GB"}, {GFD: "NVIDIA-H200"}, {GKE: "nvidia-h200-141gb"}, {KARPENTER: "h200"}]),
    ("A10", [{GFD: "NVIDIA-A10"}],
     [{GFD: "NVIDIA-A100-SXM4-40GB"}, {GKE: "nvidia-tesla-a100"}, {KARPENTER: "a100"}, {GFD: "NVIDIA-A10G"},
      {KARPENTER: "a10g"}]),
    ("L4", [{GFD: "NVIDIA-L4"}, {GKE: "nvidia-l4"}, {KARPENTER: "l4"}],
     [{GFD: "NVIDIA-L40S"}, {KARPENTER: "l40s"}, {GFD: "NVIDIA-L40"}]),
    ("A100-80GB", [{GFD: "NVIDIA-A100-SXM4-80GB"}, {GFD: "NVIDIA-A100-80GB-PCIe"}, {GKE: "nvidia-a100-80gb"},
                   {KARPENTER: "a100", KARPENTER_MEMORY: "81920"}],
     [{GFD: "NVIDIA-A100-SXM4-40GB"}, {GFD: "NVIDIA-A100-PCIE-40GB"}, {GKE: "nvidia-tesla-a100"},
      {KARPENTER: "a100", KARPENTER_MEMORY: "40960"}, {KARPENTER: "a100"}]),
    ("A100", [{GFD: "NVIDIA-A100-SXM4-40GB"}, {GKE: "nvidia-tesla-a100"}, {GKE: "nvidia-a100-80gb"},
              {KARPENTER: "a100", KARPENTER_MEMORY: "40960"}, {KARPENTER: "a100"}],
     [{GFD: "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"}, {GFD: "NVIDIA-A10"}]),
])
def test_with_no_node_to_read_the_pods_require_the_product_by_the_autoscalers_labels(accelerator, may, never):
    terms = g.node_terms(accelerator)
    assert scheduled(terms, may) == may
    assert scheduled(terms, never) == []
    assert {e["key"] for t in terms for e in t["matchExpressions"]} >= {GFD, GKE, KARPENTER}


def test_every_known_node_is_taken_exactly_when_its_value_names_the_product():
    for accelerator in ("H100", "H200", "A100", "A100-80GB", "A100-40GB", "A10G", "L4", "L40S", "T4", "V100",
                        "V100-32GB", "B200"):
        terms = g.node_terms(accelerator)
        for node in EVERY_KNOWN_NODE:
            label = next(k for k in node if k != KARPENTER_MEMORY)
            meaning = next(k for k in g.KNOWN[label] if k.value == node[label] and dict(k.also).items() <= node.items())
            assert g.node_matches(terms, node) is g.names(accelerator, meaning.value, meaning.words), (accelerator, node)


def test_karpenters_a100_needs_its_memory_to_be_an_80gb_card():
    terms = g.node_terms("A100-80GB")
    narrowed = [t["matchExpressions"] for t in terms if any(e["key"] == KARPENTER_MEMORY for e in t["matchExpressions"])]
    assert narrowed == [[{"key": KARPENTER, "operator": "In", "values": ["a100"]},
                         {"key": KARPENTER_MEMORY, "operator": "In", "values": ["81920"]}]]
    # Where every meaning of the name fits, the name alone does.
    assert not any(e["key"] == KARPENTER_MEMORY for t in g.node_terms("A100") for e in t["matchExpressions"])


def test_values_seen_on_the_nodes_join_their_labels_term():
    nodes = [{GFD: "NVIDIA-H100-SXM5-80GB"}, {GFD: "NVIDIA-A100-SXM4-80GB"}, {"gpu.nvidia.com/class": "H100_NVLINK_80GB"},
             {"gpu.nvidia.com/class": "A100_NVLINK_80GB"}, {"accelerator": "h100-pcie"}, {}]
    terms = g.node_terms("H100", nodes)
    gfd = next(t for t in terms if t["matchExpressions"][0]["key"] == GFD)["matchExpressions"][0]["values"]
    assert "NVIDIA-H100-SXM5-80GB" in gfd and "NVIDIA-H100-80GB-HBM3" in gfd and "NVIDIA-A100-SXM4-80GB" not in gfd
    assert scheduled(terms, nodes) == [nodes[0], nodes[2], nodes[4]]
    # A label only read off nodes adds no term where no node names the product by it.
    assert not any(t["matchExpressions"][0]["key"] == "accelerator" for t in g.node_terms("L4", nodes))


def test_an_unknown_product_is_required_as_written_and_as_each_project_would_spell_it():
    terms = g.node_terms("RTX-5090")
    values = {e["key"]: e["values"] for t in terms for e in t["matchExpressions"]}
    assert values == {GFD: ["NVIDIA-RTX-5090", "RTX-5090"], GKE: ["nvidia-rtx-5090"], KARPENTER: ["rtx-5090"]}
    # Spelled as the cluster's label says it, it is required as written.
    assert g.node_matches(g.node_terms("NVIDIA GeForce RTX 5090"), {GFD: "NVIDIA-GeForce-RTX-5090"})
    # And once a node of it is up, its value is read off it.
    assert g.node_matches(g.node_terms("RTX-5090", [{GFD: "NVIDIA-GeForce-RTX-5090"}]), {GFD: "NVIDIA-GeForce-RTX-5090"})


def test_the_clusters_own_label_is_used_alone():
    nodes = [{"example.com/gpu": "h100.sxm"}, {"example.com/gpu": "a100.sxm"}, {GFD: "NVIDIA-H100-80GB-HBM3"}]
    terms = g.node_terms("H100", nodes, gpu_label="example.com/gpu")
    assert terms == [{"matchExpressions": [{"key": "example.com/gpu", "operator": "In", "values": ["H100", "h100.sxm"]}]}]
    assert scheduled(terms, nodes) == [nodes[0]]
    assert g.node_terms("H100", None, gpu_label="example.com/gpu")[0]["matchExpressions"][0]["values"] == ["H100"]


def test_a_node_matches_a_term_only_when_every_expression_holds():
    terms = [{"matchExpressions": [{"key": "a", "operator": "In", "values": ["1"]},
                                   {"key": "b", "operator": "In", "values": ["2"]}]}]
    assert g.node_matches(terms, {"a": "1", "b": "2"})
    assert not g.node_matches(terms, {"a": "1"})
    assert not g.node_matches([{"matchExpressions": []}], {"a": "1"})  # an empty term matches no node
    with pytest.raises(ValueError, match="In"):
        g.node_matches([{"matchExpressions": [{"key": "a", "operator": "Exists"}]}], {"a": "1"})


def test_the_seen_products_per_label():
    nodes = [{GFD: "NVIDIA-L4"}, {GFD: "NVIDIA-L40S"}, {GKE: "nvidia-l4"}, {KARPENTER: "l40s"}]
    assert g.seen_products("L4", nodes) == {GFD: ["NVIDIA-L4"], GKE: ["nvidia-l4"]}
    assert g.seen_products("L40S", nodes) == {GFD: ["NVIDIA-L40S"], KARPENTER: ["l40s"]}
