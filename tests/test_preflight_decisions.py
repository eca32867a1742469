"""The preflight's decisions as pure functions over typed figures: no process, no socket.

`judge` names each unhealthy node with the check, its figure, the threshold and the unit; `plan`
says whether the pool drops, replaces or fails; `pair_rounds` pairs every two nodes once, in
rounds that run at once; the pool's fields are checked and named."""

from __future__ import annotations

import pytest

from skytasks import GPUPool
from skytasks.errors import PoolConfigError
from skytasks.preflight.probe import pair_rounds
from skytasks.preflight.rules import (DropNodes, FailStart, NodeFigures, RankFigures, ReplaceNodes, Rules, fold,
                                      judge, number, one_figure_per_link, plan, product_matches)

FULL = Rules(level="full")


def node(n: int, compute: float, pair: float | None = None, intra: float | None = None, **more) -> NodeFigures:
    return NodeFigures(n, f"10.0.0.{n + 1}", compute=compute, pair_gbps=pair, intra_gbps=intra, **more)


def test_a_node_far_below_the_pools_median_compute_is_named_with_its_figure_threshold_and_unit():
    verdict = judge([node(0, 40.0), node(1, 38.0), node(2, 2.0)], FULL)
    assert verdict.unhealthy == (2,)
    [finding] = verdict.findings
    assert (finding.check, finding.figure, finding.unit) == ("compute", 2.0, "GFLOPS")
    assert finding.threshold == pytest.approx(0.5 * 38.0)
    assert "node 2 (10.0.0.3)" in finding.text() and "GFLOPS" in finding.text()


def test_healthy_figures_within_the_ratio_pass_and_the_table_says_so():
    verdict = judge([node(0, 40.0, pair=5.0), node(1, 25.0, pair=4.0)], FULL)
    assert verdict.healthy
    assert [r["verdict"] for r in verdict.rows()] == ["healthy", "healthy"]
    assert verdict.rows()[0]["compute GFLOPS"] == 40.0


def test_a_user_floor_holds_even_when_every_node_is_equally_slow_and_tflops_floor_scales_to_cpu_gflops():
    verdict = judge([node(0, 30.0, pair=1.0), node(1, 30.0, pair=1.0)],
                    Rules(level="full", min_tflops=0.05, min_gbps=2.0))
    checks = sorted((f.node, f.check, f.threshold) for f in verdict.findings)
    assert checks == [(0, "compute", 50.0), (0, "pair_bandwidth", 2.0), (1, "compute", 50.0), (1, "pair_bandwidth", 2.0)]


def test_the_ratio_is_configurable():
    figures = [node(0, 40.0), node(1, 40.0), node(2, 25.0)]
    assert judge(figures, FULL).healthy
    assert judge(figures, Rules(level="full", min_ratio=0.8)).unhealthy == (2,)


def test_basic_does_not_compare_figures_but_names_a_node_that_never_answered():
    figures = [node(0, 40.0), node(1, 1.0), NodeFigures(2, "10.0.0.3", answered=False, problem="no route to host")]
    verdict = judge(figures, Rules(level="basic", timeout_seconds=20))
    [finding] = verdict.findings
    assert (finding.node, finding.check, finding.threshold, finding.unit) == (2, "collective", 20, "s")
    assert "no route to host" in finding.text()


def test_the_gpus_the_pool_promised_are_checked_count_product_and_free_memory():
    rules = Rules(accelerator="H100", accelerators_per_node=8)
    figures = [NodeFigures(0, "a", gpus=8, cuda=True, product="NVIDIA H100 80GB HBM3", free_share=0.99),
               NodeFigures(1, "b", gpus=7, cuda=True, product="NVIDIA H100 80GB HBM3", free_share=0.99),
               NodeFigures(2, "c", gpus=8, cuda=True, product="NVIDIA A100-SXM4-80GB", free_share=0.99),
               NodeFigures(3, "d", gpus=8, cuda=True, product="NVIDIA H100 80GB HBM3", free_share=0.4),
               NodeFigures(4, "e", gpus=8, cuda=False)]
    found = {(f.node, f.check) for f in judge(figures, rules).findings}
    assert found == {(1, "gpus"), (2, "product"), (3, "free_memory"), (4, "gpus")}
    # GPUs that are only a scheduler's resource (no node has CUDA): nothing to hold a node to.
    assert judge([NodeFigures(0, "a", gpus=2), NodeFigures(1, "b", gpus=0)], rules).healthy
    assert product_matches("A100", "NVIDIA A100-SXM4-80GB") and not product_matches("A10", "NVIDIA A100-SXM4-80GB")


def test_a_failed_dcgm_diagnostic_is_a_finding_on_full():
    verdict = judge([node(0, 1.0, dcgm="pass"), node(1, 1.0, dcgm="dcgmi diag -r 1: PCIe: Fail")], FULL)
    assert [(f.node, f.check) for f in verdict.findings] == [(1, "dcgm")]


def test_a_node_is_as_good_as_its_worst_rank_and_its_best_link():
    ranks = [RankFigures(0, 1, compute=30.0, compute_unit="TFLOPS", pair_gbps={0: 0.1, 2: 3.0}),
             RankFigures(1, 1, compute=5.0, compute_unit="TFLOPS")]
    folded = fold(1, "x", ranks)
    assert (folded.compute, folded.pair_gbps) == (5.0, 3.0)
    # A CPU node's ranks share its cores: its figure is theirs together.
    assert fold(1, "x", [RankFigures(0, 1, compute=3.0), RankFigures(1, 1, compute=1.0)]).compute == 4.0
    # Three nodes, one slow link set: only the node in both slow pairs is named.
    pairs = {0: {1: 3.0, 2: 0.2}, 1: {0: 3.0, 2: 0.2}, 2: {0: 0.2, 1: 0.2}}
    nodes = [fold(n, str(n), [RankFigures(n, n, compute=10.0, pair_gbps=p)]) for n, p in pairs.items()]
    assert judge(nodes, FULL).unhealthy == (2,)


def test_both_ends_of_a_link_show_its_one_figure_the_slower_ends():
    ranks = one_figure_per_link([RankFigures(0, 0, pair_gbps={1: 0.858, 2: 3.0}), RankFigures(1, 0),
                                 RankFigures(2, 1, pair_gbps={0: 0.8249}), RankFigures(4, 2, pair_gbps={0: 2.0})])
    assert [dict(r.pair_gbps) for r in ranks] == [{1: 0.8249, 2: 2.0}, {}, {0: 0.8249}, {0: 2.0}]
    nodes = [fold(n, f"10.0.0.{n + 1}", [r for r in ranks if r.node_rank == n]) for n in range(3)]
    assert [n.pair_gbps for n in nodes] == [2.0, 0.8249, 2.0]  # each node's best link, alike at both ends


def test_rank_figures_come_from_the_probes_plain_dict():
    figures = RankFigures.from_probe({"rank": 3, "node_rank": 1, "compute": 2.5, "pair_gbps": {"0": 1.5},
                                      "unknown": 1})
    assert (figures.rank, figures.node_rank, figures.compute, dict(figures.pair_gbps)) == (3, 1, 2.5, {0: 1.5})


def test_plan_drops_on_an_elastic_pool_replaces_elsewhere_and_fails_where_it_cannot():
    verdict = judge([node(0, 40.0), node(1, 40.0), node(2, 1.0)], FULL)
    assert plan(verdict, nodes=3, fewest=2, replaces_elsewhere=False, replacements_left=0) == DropNodes((2,))
    assert plan(verdict, nodes=3, fewest=3, replaces_elsewhere=True, replacements_left=1) == ReplaceNodes((2,))
    no_host = plan(verdict, nodes=3, fewest=3, replaces_elsewhere=False, replacements_left=3)
    assert isinstance(no_host, FailStart) and "node 2 (10.0.0.3)" in no_host.reason and "GFLOPS" in no_host.reason
    assert "2 healthy node(s), fewer than the 3 it needs" in no_host.reason
    assert "min_nodes" not in no_host.reason  # a fixed pool: the user never set min_nodes
    spent = plan(verdict, nodes=3, fewest=3, replaces_elsewhere=True, replacements_left=0)
    assert isinstance(spent, FailStart) and "node_recoveries" in spent.reason
    # An elastic pool that would fall below min_nodes replaces only what keeps it at min_nodes.
    two_bad = judge([node(0, 40.0), node(1, 1.0), node(2, 1.0), node(3, 40.0)], FULL)
    assert plan(two_bad, nodes=4, fewest=3, replaces_elsewhere=True, replacements_left=1) == ReplaceNodes((1, 2))
    elastic = plan(two_bad, nodes=4, fewest=3, replaces_elsewhere=False, replacements_left=1)
    assert isinstance(elastic, FailStart) and "2 healthy node(s), fewer than the 3 it needs" in elastic.reason


def test_figures_and_thresholds_read_as_numbers_never_in_e_notation():
    verdict = judge([node(0, 80.0, pair=0.676), node(1, 90.0, pair=0.7)],
                    Rules(level="full", min_tflops=5.0, min_gbps=10000.0))
    said = " ".join(f.text() for f in verdict.findings)
    assert "(threshold 5000 GFLOPS)" in said and ": 80 GFLOPS" in said
    assert ": 0.676 GB/s (threshold 10000 GB/s)" in said and "e+" not in said
    assert [number(x) for x in (999.7, 999.4, 0.00005, 0.000123456, 0.0, -2.5)] == [
        "1000", "999", "0.0000500", "0.000123", "0", "-2.5"]


@pytest.mark.parametrize("nodes", range(1, 9))
def test_pair_rounds_pair_every_two_nodes_once_and_no_node_twice_in_a_round(nodes):
    rounds = pair_rounds(nodes)
    pairs = [p for r in rounds for p in r]
    assert sorted(pairs) == [(a, b) for a in range(nodes) for b in range(a + 1, nodes)]
    for r in rounds:
        busy = [n for p in r for n in p]
        assert len(busy) == len(set(busy))


@pytest.mark.parametrize("fields, named", [
    (dict(preflight="fast"), "preflight"),
    (dict(preflight_min_ratio=1.5), "preflight_min_ratio"),
    (dict(preflight_timeout_seconds=0), "preflight_timeout_seconds"),
    (dict(preflight_min_tflops=-1.0), "preflight_min_tflops"),
    (dict(preflight_min_gbps=0), "preflight_min_gbps"),
])
def test_a_bad_preflight_field_is_a_pool_config_error_naming_it(fields, named):
    with pytest.raises(PoolConfigError) as caught:
        GPUPool(nodes=2, **fields)
    assert str(caught.value).startswith(named + ":")


def test_the_preflight_fields_reach_the_spec_and_read_back_flat():
    pool = GPUPool(nodes=2, preflight="full", preflight_min_ratio=0.7, preflight_min_gbps=3.0,
                   preflight_timeout_seconds=12)
    spec = pool.spec()
    assert (spec.preflight, spec.preflight_min_ratio, spec.preflight_min_gbps, spec.preflight_timeout_seconds) == (
        "full", 0.7, 3.0, 12)
    assert (pool.preflight_min_ratio, pool.preflight_min_tflops) == (0.7, None)
    assert GPUPool(nodes=2).spec().preflight == "basic"


def test_a_replacement_pod_keeps_off_the_avoided_kubernetes_nodes_in_every_term_and_only_narrows():
    from skytasks.providers.kubernetes.avoid import avoid_hosts

    bare = {"spec": {"containers": []}}
    assert avoid_hosts(bare, []) is bare and avoid_hosts(bare, [""]) is bare
    kept_off = avoid_hosts(bare, ["gpu-7", "gpu-3"])
    [term] = kept_off["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert term["matchExpressions"] == [{"key": "kubernetes.io/hostname", "operator": "NotIn",
                                         "values": ["gpu-3", "gpu-7"]}]
    product = {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["H100"]}
    two_terms = {"spec": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [product]}, {"matchFields": []}]}}}}}
    narrowed = avoid_hosts(two_terms, ["gpu-7"])["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert [t["matchExpressions"][-1]["values"] for t in narrowed] == [["gpu-7"], ["gpu-7"]]
    assert narrowed[0]["matchExpressions"][0] == product  # the pool's own term is kept
    assert two_terms["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"][0] == {"matchExpressions": [product]}  # the pool's manifest is not changed


def test_the_flight_recorder_names_the_rank_that_never_joined_the_collective_the_others_wait_in():
    from skytasks.flight_recorder import never_joined

    def entries(*seqs: int, pg: int = 0) -> dict:
        return {"entries": [{"pg_id": pg, "collective_seq_id": s, "profiling_name": "nccl:all_reduce",
                             "state": "completed"} for s in seqs]}

    dumps = {0: entries(1, 2, 3), 1: entries(1, 2), 2: entries(1, 2, 3), 3: entries(1, 2, 3)}
    [stuck] = never_joined(dumps)
    assert (stuck.seq, stuck.entered, stuck.missing, stuck.name) == (3, (0, 2, 3), (1,), "nccl:all_reduce")
    assert "ranks [1] never joined" in stuck.text()
    assert never_joined({0: entries(1, 2), 1: entries(1, 2)}) == []  # every rank in step: no evidence of a hang
    # A rank with no collective in its dump (only point-to-point ops, seq 0) is no evidence: left out.
    assert never_joined({0: entries(5), 1: {"entries": [{"pg_id": 0, "collective_seq_id": 0}]}}) == []
