"""Expected bus bandwidth from the topology, and the verdict on a measured table."""

from __future__ import annotations

import statistics

import pytest

from diag.analyzers.diagnosis import bandwidth
from diag.analyzers.diagnosis.decision_tree import load_tree
from diag.analyzers.nccl import expected as ne
from diag.analyzers.nccl import log as nccl_log
from diag.analyzers.nccl import nccl_tests


def _judge(test: dict, topo: dict, tree=None) -> dict:
    """The test's bandwidth facts, judged as the diagnosis judges them."""
    return bandwidth.judge(ne.bandwidth_facts(test, topo), tree or load_tree())

def _test_with_busbw(busbw: float, world: int = 16, hosts: int = 2, size: int = 1 << 30) -> dict:
    row = {"size_bytes": size, "count": size // 4, "dtype": "float", "redop": "sum", "root": -1,
           "out_of_place": {"time_us": 1.0, "algbw_gbps": busbw / 1.875, "busbw_gbps": busbw, "wrong": 0},
           "in_place": {"time_us": 1.0, "algbw_gbps": busbw / 1.875, "busbw_gbps": busbw * 0.99, "wrong": 0}}
    return {"collective": "all_reduce", "world_size": world, "backend": "nccl", "rows": [row],
            "hosts": [f"node{i}" for i in range(hosts)], "status": "ok", "errors": []}


def test_link_table_and_names():
    assert ne.LINKS["ib_hdr"].gbps == 25.0 and ne.LINKS["ib_ndr"].gbps == 50.0
    assert ne.LINKS["roce_400"].gbps == 50.0 and ne.LINKS["ib_edr"].gbps == 12.5
    assert ne.LINKS["nvlink3"].gbps == 300.0 and ne.LINKS["nvlink4"].gbps == 450.0
    assert ne.LINKS["nvlink5"].gbps == 900.0 and ne.LINKS["nvlink1"].gbps == 80.0
    assert ne.LINKS["pcie4"].gbps == 31.5 and ne.LINKS["pcie5"].gbps == 63.0
    assert ne.link_key("NVLink-4") == "nvlink4"
    assert ne.link_key("gen5") == "pcie5"
    assert ne.link_key("HDR") == "ib_hdr"
    assert ne.link_key("roce400") == "roce_400"
    assert ne.link_key("100GbE") == "eth_100"
    with pytest.raises(ValueError):
        ne.link_key("token-ring")


def test_expected_is_the_slower_of_gpu_link_and_node_nics():
    topo = ne.topology_from_flags(intra="nvlink4", inter="ib_hdr", nics_per_node=8)
    one_node = ne.expected_busbw(topo, nodes=1, gpus_per_node=8)
    assert one_node["expected_busbw_gbps"] == pytest.approx(450 * 0.8)
    assert one_node["bottleneck"] == "gpu link"
    two_nodes = ne.expected_busbw(topo, nodes=2, gpus_per_node=8)
    assert two_nodes["expected_busbw_gbps"] == pytest.approx(8 * 25 * 0.96)
    assert two_nodes["bottleneck"] == "network"
    few_nics = ne.topology_from_flags(intra="nvlink4", inter="ib_hdr", nics_per_node=2)
    assert ne.expected_busbw(few_nics, nodes=4, gpus_per_node=8)["expected_busbw_gbps"] == pytest.approx(48.0)
    assert ne.expected_busbw(ne.empty_topology(), nodes=2)["expected_busbw_gbps"] is None


def test_real_four_nic_cluster_reaches_its_expectation(real_nccl):
    """nccl-tests issue 119: the maintainer's target for 4 x 200 Gb/s NICs is 96 GB/s."""
    test = nccl_tests.parse_file(real_nccl / "nccltests_NVIDIA-nccl-tests_119.txt")["tests"][0]
    topo = ne.topology_from_flags(inter="ib_hdr", nics_per_node=4, nodes=2)
    verdict = _judge(test, topo)
    assert verdict["expected_busbw_gbps"] == pytest.approx(96.0)
    measured = sorted(max(r["out_of_place"]["busbw_gbps"], r["in_place"]["busbw_gbps"]) for r in test["rows"])
    assert verdict["measured_busbw_gbps"] == pytest.approx((measured[2] + measured[3]) / 2)
    assert verdict["pct_of_expected"] == pytest.approx(100 * verdict["measured_busbw_gbps"] / 96.0)
    assert verdict["flags"] == [] and verdict["diagnosis"].endswith("healthy")


def test_collapse_at_large_messages_is_flagged_below_50(real_nccl):
    """nccl issue 1453: busbw falls from ~29 GB/s to ~5 GB/s from 64 MiB on."""
    test = nccl_tests.parse_file(real_nccl / "nccltests_NVIDIA-nccl_1453.txt")["tests"][0]
    topo = ne.topology_from_flags(inter="ib_hdr", nics_per_node=1, nodes=2)
    verdict = _judge(test, topo)
    large = [max(r["out_of_place"]["busbw_gbps"], r["in_place"]["busbw_gbps"])
             for r in test["rows"] if r["size_bytes"] >= 64 << 20]
    assert len(large) == 4
    assert verdict["measured_busbw_gbps"] == pytest.approx(statistics.median(large))
    assert "below_50" in verdict["flags"]
    assert verdict["pct_of_expected"] < 50


def test_socket_fallback_sentence_from_a_real_nccl_log(real_nccl):
    log = nccl_log.parse_files([real_nccl / "nccllog_NVIDIA-nccl_1232.txt"])
    from_log = ne.topology_from_nccl_log(log)
    assert from_log["transport"] == "socket" and from_log["nodes"] == 2
    topo = ne.merge_topology(from_log, ne.topology_from_flags(inter="ib_hdr", nics_per_node=1))
    expected = 25.0 * 0.96
    verdict = _judge(_test_with_busbw(0.11 * expected), topo)
    assert verdict["diagnosis"] == "inter-node traffic fell back to TCP sockets: 11% of the expected bus bandwidth"
    assert "below_50" in verdict["flags"]


def test_nccl_log_transports_and_ranks(real_nccl):
    topo = ne.topology_from_nccl_log(nccl_log.parse_files([real_nccl / "nccllog_NVIDIA-nccl-tests_252.txt"]))
    assert topo["intra_transport"] == "p2p"
    assert topo["nodes"] == 2 and topo["gpus_per_node"] == 4


def test_flags_at_80_and_50_percent():
    topo = ne.topology_from_flags(intra="nvlink3", gpus_per_node=8, nodes=1)
    expected = 300 * 0.8
    for pct, flags in ((95, []), (70, ["below_80"]), (30, ["below_50"]), (140, ["above_expected"])):
        v = _judge(_test_with_busbw(expected * pct / 100, world=8, hosts=1), topo)
        assert v["flags"] == flags
        assert v["pct_of_expected"] == pytest.approx(pct)
        assert v["diagnosis"].startswith(f"{pct}% of the expected bus bandwidth")
    single = _judge(_test_with_busbw(0.0, world=1, hosts=1), topo)
    assert single["pct_of_expected"] is None and "single rank" in single["diagnosis"]
    # The factor as the help and the README give it: all_reduce's is 2(n-1)/n.
    assert "2(n-1)/n for all_reduce" in single["diagnosis"]


def test_bandwidth_thresholds_are_the_tree_s():
    """Each threshold moves the judgement from its own side: 70% is below a healthy 80%, and
    healthy once busbw_healthy is 60%; 40% is bad under 50% and only low under 30%."""
    topo = ne.topology_from_flags(intra="nvlink3", gpus_per_node=8, nodes=1)
    expected = 300 * 0.8

    def flags(pct, **overrides):
        return _judge(_test_with_busbw(expected * pct / 100, world=8, hosts=1), topo,
                      load_tree(overrides=overrides))["flags"]

    assert flags(70) == ["below_80"] and flags(70, busbw_healthy=0.6) == []
    assert flags(40) == ["below_50"] and flags(40, busbw_bad=0.3) == ["below_80"]
    assert flags(120) == ["above_expected"] and flags(120, busbw_above=1.3) == []


def test_nvidia_smi_topology_matrix():
    # The matrix layout of `nvidia-smi topo -m` on an 8-GPU NVSwitch node with 4 NICs.
    gpus = [f"GPU{i}" for i in range(8)]
    header = "\t" + "\t".join(gpus + ["NIC0", "NIC1", "NIC2", "NIC3", "CPU Affinity", "NUMA Affinity"])
    rows = []
    for i, g in enumerate(gpus):
        cells = [" X " if j == i else "NV12" for j in range(8)] + ["PXB", "SYS", "SYS", "SYS", "0-63", "0"]
        rows.append(g + "\t" + "\t".join(cells))
    nics = [f"NIC{i}\t" + "\t".join(["PXB"] * 8 + ["X"] * 4) for i in range(4)]
    legend = ["", "Legend:", "", "  X    = Self", "", "NIC Legend:", ""] + [f"  NIC{i}: mlx5_{i}" for i in range(4)]
    topo = ne.topology_from_nvidia_smi("\n".join([header, *rows, *nics, *legend]))
    assert topo["gpus_per_node"] == 8 and topo["nics_per_node"] == 4
    assert topo["intra"] == "nvlink3" and topo["intra_gbps"] == pytest.approx(300.0)
    pcie = "\n".join(["\tGPU0\tGPU1\tCPU Affinity", "GPU0\t X \tSYS\t0-15", "GPU1\tSYS\t X \t0-15"])
    assert ne.topology_from_nvidia_smi(pcie)["intra"] == "pcie4"
    with pytest.raises(ValueError):
        ne.topology_from_nvidia_smi("no matrix here")


def test_a_network_named_for_a_run_of_unknown_nodes_is_no_silent_single_node_figure():
    """`--inter` with a 24-rank output that names no hosts: the nodes are unknown, so no figure
    from the GPU link alone is given as if the run were on one node; the flags to pass are named."""
    topo = ne.topology_from_flags(intra="nvlink4", inter="ib_ndr", nics_per_node=8)
    facts = ne.bandwidth_facts({"world_size": 24, "rows": []}, topo)
    assert facts["expected_busbw_gbps"] is None and "--nodes or --gpus-per-node" in facts["expected_basis"]
    with_nodes = ne.bandwidth_facts({"world_size": 24, "rows": []},
                                    ne.topology_from_flags(intra="nvlink4", inter="ib_ndr", nics_per_node=8,
                                                           gpus_per_node=8))
    assert with_nodes["nodes"] == 3 and with_nodes["expected_busbw_gbps"] is not None
    # Without a network named, one node's figure stands as before.
    assert ne.bandwidth_facts({"world_size": 8, "rows": []},
                              ne.topology_from_flags(intra="nvlink4"))["expected_busbw_gbps"] is not None
