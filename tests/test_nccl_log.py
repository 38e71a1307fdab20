"""NCCL / RCCL / PyTorch log parser on every log in ../shared/data/nccl, its findings, its
bounded memory, and the `diag nccl-log` command (run as a subprocess)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import pytest
from conftest import REPO, real_data_dir

from diag.analyzers.diagnosis.nccl_log import judged, summary_sentences
from diag.analyzers.nccl import log as nccl_log
from diag.analyzers.nccl.ib_status import IBV_WC_STATUS
from diag.analyzers.nccl.log import NcclLogParser
from diag.analyzers.nccl.log_grammar import SCHEMA
from diag.errors import DiagInputError


# The parsed logs as `diag nccl-log` shows them: the parser's facts with the diagnosis's findings.
def parse_lines(*args, **kwargs) -> dict:
    return judged(nccl_log.parse_lines(*args, **kwargs))


def parse_files(*args, **kwargs) -> dict:
    return judged(nccl_log.parse_files(*args, **kwargs))


def parse_file(*args, **kwargs) -> dict:
    return judged(nccl_log.parse_file(*args, **kwargs))


LOG_PREFIXES = ("nccllog_", "rccllog_", "torchlog_", "torchfr_", "inspector_")

# file -> (version, backend, number of hosts, world size, transports by kind, finding ids)
EXPECTED = {
    "inspector_NVIDIA-nccl_README.txt": (None, None, 2, 8, {}, set()),
    "nccllog_NVIDIA-nccl-tests_100.txt": (None, "nccl", 1, None, {"P2P/IPC": 4}, set()),
    "nccllog_NVIDIA-nccl-tests_131.txt": ("2.16.5+cuda11.8", "nccl", 1, None, {},
                                          {"p2p_disabled", "ibverbs_missing", "topology_fallback",
                                           "socket_virtual_interface"}),
    "nccllog_NVIDIA-nccl-tests_166.txt": ("2.18.3+cuda12.2", "nccl", 1, None, {},
                                          {"net_socket_fallback", "ibverbs_missing", "cuda_library_missing"}),
    "nccllog_NVIDIA-nccl-tests_188.txt": (None, "nccl", 1, None, {}, {"nvls_unavailable"}),
    "nccllog_NVIDIA-nccl-tests_228.txt": (None, "nccl", 1, None, {}, set()),
    "nccllog_NVIDIA-nccl-tests_252.txt": (None, "nccl", 2, 8, {"P2P/CUMEM": 7}, set()),
    "nccllog_NVIDIA-nccl-tests_29.txt": (None, "nccl", 4, 32, {}, set()),
    "nccllog_NVIDIA-nccl_1154_tuning_table.txt": (None, "nccl", 1, None, {}, {"algo_forced"}),
    "nccllog_NVIDIA-nccl_1193.txt": (None, "nccl", 3, 128, {}, set()),
    "nccllog_NVIDIA-nccl_1232.txt": (None, "nccl", 2, None, {"NET/Socket": 8, "SHM": 2},
                                     {"net_socket_fallback", "intra_node_shm"}),
    "nccllog_NVIDIA-nccl_1238.txt": (None, "nccl", 1, 1, {}, set()),
    "nccllog_NVIDIA-nccl_1357.txt": (None, "nccl", 2, 16, {}, set()),
    "nccllog_NVIDIA-nccl_1412.txt": (None, "nccl", 1, None, {"P2P/direct": 10, "NET/IB": 4}, {"ib_no_gdrdma"}),
    "nccllog_NVIDIA-nccl_147.txt": (None, "nccl", 1, 8, {}, set()),
    "nccllog_NVIDIA-nccl_1612.txt": (None, "nccl", 0, None, {}, {"socket_error", "init_failure"}),
    "nccllog_NVIDIA-nccl_226.txt": (None, "nccl", 16, 64, {"NET/Socket": 11}, {"net_socket_fallback"}),
    "nccllog_NVIDIA-nccl_584.txt": (None, "nccl", 1, 2, {}, set()),
    "nccllog_NVIDIA-nccl_707.txt": (None, "nccl", 1, None, {"NET/IB/GDRDMA": 12}, set()),
    "nccllog_NVIDIA-nccl_754_tuning_table.txt": (None, "nccl", 1, None, {}, set()),
    "rccllog_ROCm-rccl_2188.txt": ("2.27.7", "rccl", 1, None, {}, {"rocm_iommu", "ib_no_device"}),
    "torchfr_pytorch-tutorials_flight_recorder.txt": (None, None, 0, None, {}, {"desync"}),
    "torchlog_OFA-Sys-OFA_271.txt": (None, None, 0, None, {}, {"collective_timeout"}),
    "torchlog_XPixelGroup-BasicSR_737.txt": (None, None, 0, None, {}, {"collective_timeout"}),
    "torchlog_hiyouga-LlamaFactory_6269.txt": (None, None, 0, None, {}, {"collective_timeout"}),
}


def _log_names():
    d = real_data_dir()
    if d is None or not (d / "nccl").is_dir():
        return sorted(EXPECTED)
    return sorted(f.name for f in (d / "nccl").iterdir() if f.name.startswith(LOG_PREFIXES))


def _doc(real_nccl, name):
    return parse_file(real_nccl / name)


def test_every_log_file_is_expected(real_nccl):
    names = [f.name for f in real_nccl.iterdir() if f.name.startswith(LOG_PREFIXES)]
    assert sorted(names) == sorted(EXPECTED)


@pytest.mark.parametrize("name", _log_names())
def test_log_summary_and_findings(real_nccl, name):
    doc = _doc(real_nccl, name)
    version, backend, nhosts, world, kinds, findings = EXPECTED[name]
    assert doc["schema"] == SCHEMA
    assert set(doc) >= {"schema", "nccl_version", "hosts", "ranks", "transports", "collectives", "warnings",
                        "signals", "findings"}
    assert doc["nccl_version"] == version
    assert doc["backend"] == backend
    assert len(doc["hosts"]) == nhosts
    assert doc["world_size"] == world
    assert doc["transports"]["by_kind"] == kinds
    assert {f["id"] for f in doc["findings"]} == findings
    assert "findings" not in nccl_log.parse_file(real_nccl / name)  # the parser writes facts only
    for f in doc["findings"]:
        assert f["severity"] in ("critical", "warning", "info")
        assert f["message"] and f["evidence"], f
        assert len(f["evidence"]) <= 5


def test_a_socket_on_a_vm_bridge_is_named_with_the_interface_to_use(real_nccl):
    # "NET/Socket : Using [0]eth0:192.168.0.183<0> [1]virbr0:192.168.122.1<0>": libvirt's bridge.
    doc = _doc(real_nccl, "nccllog_NVIDIA-nccl-tests_131.txt")
    assert [(i["role"], i["name"], i["address"]) for i in doc["transports"]["interfaces"]] == [
        ("bootstrap", "eth0", "192.168.0.183"), ("socket", "eth0", "192.168.0.183"),
        ("socket", "virbr0", "192.168.122.1")]
    (f,) = [f for f in doc["findings"] if f["id"] == "socket_virtual_interface"]
    assert "virbr0 (virtual-machine bridge, 192.168.122.1)" in f["message"]
    assert f["severity"] == "info"  # one node: no traffic leaves it yet
    assert f["advice"].startswith("Set NCCL_SOCKET_IFNAME=eth0, or exclude it with NCCL_SOCKET_IFNAME=^virbr0")
    assert f["evidence"] == ["Meowth:8756:8771 [0] NCCL INFO NET/Socket : Using [0]eth0:192.168.0.183<0> "
                             "[1]virbr0:192.168.122.1<0>"]


@pytest.mark.parametrize("name,interfaces", [
    ("nccllog_NVIDIA-nccl-tests_166.txt", {("bootstrap", "ens4"), ("socket", "ens4")}),
    ("nccltests_NVIDIA-nccl_1812.txt", {("bootstrap", "eth0")}),
    ("nccllog_NVIDIA-nccl-tests_228.txt", {("oob", "ibs85f0")}),  # the OOB interface of NET/IB
])
def test_physical_interfaces_raise_nothing(real_nccl, name, interfaces):
    doc = _doc(real_nccl, name)
    assert {(i["role"], i["name"]) for i in doc["transports"]["interfaces"]} == interfaces
    assert "socket_virtual_interface" not in {f["id"] for f in doc["findings"]}


@pytest.mark.parametrize("name,address,kind", [
    ("docker0", "172.17.0.1", "container bridge"), ("veth3f2a1c", "10.1.0.5", "container veth pair"),
    ("virbr0", "192.168.122.1", "virtual-machine bridge"), ("ip6tnl0", "2001:db8::1", "tunnel"),
    ("tun0", "10.8.0.2", "tunnel"), ("wg0", "10.0.0.7", "VPN"), ("flannel.1", "10.244.0.0", "container overlay"),
    ("lo", "127.0.0.1", "loopback"), ("eth0", "127.0.0.2", "loopback"),
    ("eth1", "169.254.10.2", "link-local address"), ("ib0", "fe80::1%ib0", "link-local address"),
    ("eth0", "10.0.0.1", None), ("ens4", "10.0.0.2", None), ("enp1s0f0", "192.168.1.10", None),
    ("ibs85f0", "192.168.1.10", None), ("bond0", "10.2.3.4", None), ("local0", "10.0.0.3", None),
])
def test_interface_kinds(name, address, kind):
    from diag.analyzers.nccl.interfaces import interface_kind

    assert interface_kind(name, address) == kind


def test_a_virtual_interface_between_nodes_is_a_warning_with_the_bootstrap_too():
    from diag.analyzers.diagnosis.nccl_log import RULES_BY_ID

    doc = {"nodes": 2, "communicators": [], "env": {"NCCL_SOCKET_IFNAME": "d"},
           "transports": {"interfaces": [
               {"role": "bootstrap", "name": "docker0", "address": "172.17.0.1", "line": "a", "kind": "container bridge"},
               {"role": "socket", "name": "docker0", "address": "172.17.0.1", "line": "b", "kind": "container bridge"}]}}
    res = RULES_BY_ID["socket_virtual_interface"].check(doc, {})
    assert res["severity"] == "warning" and "other nodes cannot reach it" in res["message"]
    assert "NCCL_SOCKET_IFNAME=<the interface the nodes reach each other on>" in res["advice"]
    assert "NCCL_SOCKET_IFNAME=^docker0" in res["advice"] and "it is now 'd'" in res["advice"]
    assert "MASTER_ADDR" in res["advice"] and res["evidence"] == ["a", "b"]


def test_ranks_devices_bus_ids_and_communicator(real_nccl):
    doc = _doc(real_nccl, "nccllog_NVIDIA-nccl-tests_252.txt")
    ranks = {r["rank"]: r for r in doc["ranks"]}
    assert sorted(ranks) == [0, 1, 4, 5, 6, 7]
    assert (ranks[6]["host"], ranks[6]["cuda_dev"], ranks[6]["nvml_dev"], ranks[6]["bus_id"]) == ("kolyoz2", 2, 2, "d4000")
    assert ranks[0]["comm_id"] == "0x996ee6f117cb8e1e" and ranks[0]["pid"] == 27255
    (comm,) = doc["communicators"]
    assert (comm["comm_id"], comm["nranks"], comm["ranks_seen"], comm["init_complete"]) == (
        "0x996ee6f117cb8e1e", 8, 6, 1)
    ch = doc["channels"]
    assert (ch["coll_channels"], ch["collnet_channels"], ch["nvls_channels"], ch["p2p_channels"]) == (8, 8, 0, 8)
    assert doc["collnet"]["channels"] == 8 and doc["nvls"]["channels"] == 0
    peer = next(p for p in doc["transports"]["peers"] if (p["from"], p["to"]) == (7, 5))
    assert peer["via"] == "P2P/CUMEM" and sorted(peer["channels"]) == [3, 7]


def test_old_init_complete_lines(real_nccl):
    doc = _doc(real_nccl, "nccllog_NVIDIA-nccl-tests_29.txt")
    assert len(doc["ranks"]) == 12 and {r["nranks"] for r in doc["ranks"]} == {32}
    r24 = next(r for r in doc["ranks"] if r["rank"] == 24)
    assert (r24["host"], r24["cuda_dev"], r24["bus_id"]) == ("server4", 0, None)
    assert doc["communicators"][0]["init_complete"] == 12


def test_rings_trees_and_p2p_ipc(real_nccl):
    doc = _doc(real_nccl, "nccllog_NVIDIA-nccl-tests_100.txt")
    rings = doc["channels"]["rings"]
    assert [r["channel"] for r in rings] == [19, 20, 21, 22, 23] and rings[0]["channels"] == 24
    assert rings[0]["order"] == list(range(8))
    trees = doc["channels"]["trees"]
    assert trees["channels"] == 24 and trees["roots"] == [0] and trees["notation"] == "down->rank->up"
    (peer,) = doc["transports"]["peers"]
    assert (peer["from"], peer["to"], peer["via"], peer["channels"]) == (0, 1, "P2P/IPC/read", [0, 1, 2, 3])
    doc = _doc(real_nccl, "nccllog_NVIDIA-nccl-tests_188.txt")
    assert doc["channels"]["rings"][0]["order"] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 15, 14, 13, 12, 11, 10, 9]
    doc = _doc(real_nccl, "nccllog_NVIDIA-nccl_1357.txt")
    assert doc["channels"]["trees"]["roots"] == [6] and doc["nvls"]["heads"] == 4
    assert doc["nvls"]["available_devices"] == 4 and doc["nodes"] == 2
    doc = _doc(real_nccl, "nccllog_NVIDIA-nccl_226.txt")
    assert doc["channels"]["trees"]["notation"] == "up->rank->down"


def test_net_transports_with_and_without_gdrdma(real_nccl):
    doc = _doc(real_nccl, "nccllog_NVIDIA-nccl_1412.txt")
    t = doc["transports"]
    assert (t["gdrdma"], t["no_gdrdma"]) == (0, 4)
    f = next(f for f in doc["findings"] if f["id"] == "ib_no_gdrdma")
    assert f["severity"] == "warning" and "via NET/IB/3" in f["evidence"][0]
    doc = _doc(real_nccl, "nccllog_NVIDIA-nccl_707.txt")
    assert (doc["transports"]["gdrdma"], doc["transports"]["no_gdrdma"]) == (12, 0)
    p = next(p for p in doc["transports"]["peers"] if (p["from"], p["to"], p["via"]) == (2, 0, "NET/IB/5/GDRDMA"))
    assert p["direction"] == "receive" and p["gdrdma"] is True


def test_socket_fallback_between_nodes(real_nccl):
    doc = _doc(real_nccl, "nccllog_NVIDIA-nccl_1232.txt")
    f = doc["findings"][0]
    assert f["id"] == "net_socket_fallback" and f["severity"] == "critical"
    assert "between nodes" in f["message"] and "via NET/Socket/0" in f["evidence"][0]
    assert summary_sentences(doc["findings"])[0] == "NCCL fell back to TCP sockets between nodes"
    # two processes on hosts both named "ubuntu" but bootstrapping from two addresses
    doc = _doc(real_nccl, "nccllog_NVIDIA-nccl-tests_166.txt")
    assert doc["nodes"] == 2 and doc["processes"] == 2
    assert any("Using network Socket" in e for e in doc["findings"][0]["evidence"])
    # one node using the Socket network plugin is not a fallback
    assert "net_socket_fallback" not in {f["id"] for f in _doc(real_nccl, "nccllog_NVIDIA-nccl-tests_131.txt")["findings"]}


def test_coll_lines_aggregated(real_nccl):
    doc = _doc(real_nccl, "nccllog_NVIDIA-nccl_1193.txt")
    (c,) = doc["collectives"]
    assert (c["op"], c["calls"], c["elements"], c["bytes"]) == ("AllReduce", 4, 28897600, 28897600 * 4)
    assert c["dtypes"] == {"float32": 4} and c["redops"] == {"sum": 4} and c["nranks"] == [128]
    assert doc["max_op_count"] == 0x139E
    doc = _doc(real_nccl, "nccllog_NVIDIA-nccl_147.txt")
    (c,) = doc["collectives"]
    # six lines, one with two prefixes and one with none; int64 (4) and half (6) datatypes
    assert c["calls"] == 6 and c["dtypes"] == {"int64": 3, "float16": 3}
    assert c["bytes"] == 3 * 53 * 8 + 3 * 25503912 * 2
    doc = _doc(real_nccl, "nccllog_NVIDIA-nccl_584.txt")
    assert [(c["op"], c["calls"], c["comms"]) for c in doc["collectives"]] == [("Send", 6, 2), ("Recv", 1, 1)]
    assert doc["max_op_count"] == 0xD62


def test_tuning_tables_both_layouts(real_nccl):
    doc = _doc(real_nccl, "nccllog_NVIDIA-nccl_754_tuning_table.txt")
    table = doc["tuning"]["table"]
    assert table["Broadcast"]["Ring/Simple"] == {"latency_us": 18.0, "algbw_gbps": 3.0}
    assert table["Reduce"]["Ring/LL"] == {"latency_us": 6.3, "algbw_gbps": 0.8}
    assert table["Reduce"]["CollNet/LL"] == {"latency_us": 0.0, "algbw_gbps": 0.0}
    doc = _doc(real_nccl, "nccllog_NVIDIA-nccl_1154_tuning_table.txt")
    assert doc["tuning"]["table"]["Broadcast"]["Tree/LL"] == {"latency_us": 0.0, "algbw_gbps": 0.0}
    assert doc["env"]["NCCL_ALGO"] == "Tree" and doc["tuning"]["env"] == {"NCCL_ALGO": "Tree"}


def test_warnings_error_chain_and_init_failure(real_nccl):
    doc = _doc(real_nccl, "nccllog_NVIDIA-nccl_1612.txt")
    (w,) = doc["warnings"]
    assert w["location"] == "misc/socket.cc:71" and w["message"].startswith("socketProgress: Connection closed")
    (chain,) = doc["error_chains"]
    assert chain["code"] == 6 and chain["code_name"] == "ncclRemoteError" and chain["async"] is True
    assert chain["frames"][0] == "misc/socket.cc:80" and chain["frames"][-1] == "group.cc:106"
    assert "bootstrap.cc:701" in chain["frames"] and "init.cc:1402" in chain["frames"]
    f = next(f for f in doc["findings"] if f["id"] == "init_failure")
    assert "ncclRemoteError" in f["message"]


def test_rccl_banner_and_timestamped_warn(real_nccl):
    doc = _doc(real_nccl, "rccllog_ROCm-rccl_2188.txt")
    assert doc["rccl"] == {"hip_version": "7.2.53211-97f5574fe2", "rocm_version": "7.2.4.0-93-97f5574fe2",
                           "librccl_path": "/usr/local/lib/librccl.so.1", "build": "HEAD:29e1567"}
    assert doc["versions"] == ["2.27.7"]
    (w,) = doc["warnings"]
    assert w["count"] == 2 and w["location"].endswith("init.cc:213") and "iommu=pt" in w["message"]


def test_watchdog_timeouts(real_nccl):
    doc = _doc(real_nccl, "torchlog_XPixelGroup-BasicSR_737.txt")
    (t,) = doc["timeouts"]
    assert (t["op"], t["seq"], t["timeout_ms"], t["numel_in"], t["ranks"]) == ("ALLREDUCE", 808, 600000, 9801523, [0, 1, 2])
    assert t["ran_ms"] == 600061
    assert [(w["rank"], w["work"], w["last_completed"], w["last_enqueued"]) for w in doc["watchdog"]] == [
        (0, 808, 807, 811), (1, 808, 807, 811)]
    f = doc["findings"][0]
    assert f["id"] == "collective_timeout" and "ALLREDUCE SeqNum 808" in f["message"] and "600 s" in f["message"]
    doc = _doc(real_nccl, "torchlog_OFA-Sys-OFA_271.txt")
    (t,) = doc["timeouts"]
    assert (t["seq"], t["timeout_ms"], t["numel_in"], t["ranks"]) == (469508, 1800000, None, [1, 2, 3, 6, 7])
    doc = _doc(real_nccl, "torchlog_hiyouga-LlamaFactory_6269.txt")
    (t,) = doc["timeouts"]
    assert (t["op"], t["numel_in"], t["numel_out"], t["ranks"]) == ("_REDUCE_SCATTER_BASE", 544997376, 68124672, [0, 3, 4])
    assert {w["pg"] for w in doc["watchdog"]} == {"1"}
    # every rank stuck at the same collective: a timeout, not a desync
    assert "desync" not in {f["id"] for f in doc["findings"]}


def test_desync_across_ranks_from_real_lines(real_nccl):
    # Ranks of two real logs stuck at different sequence numbers.
    lines = (real_nccl / "torchlog_XPixelGroup-BasicSR_737.txt").read_text().splitlines()
    lagging = [ln.replace("[Rank 2]", "[Rank 5]").replace("SeqNum=808", "SeqNum=807") for ln in lines if "[Rank 2]" in ln]
    doc = parse_lines(lines + lagging)
    f = next(f for f in doc["findings"] if f["id"] == "desync")
    assert "SeqNum 807: rank 5" in f["message"] and "SeqNum 808: ranks 0, 1, 2" in f["message"]


def test_flight_recorder(real_nccl):
    doc = _doc(real_nccl, "torchfr_pytorch-tutorials_flight_recorder.txt")
    fr = doc["flight_recorder"]
    assert fr["ops"] == {"nccl:all_reduce": 1} and fr["states"] == {"completed": 1} and fr["timeout_ms"] == 600000
    assert fr["pg_status"] == {"last_enqueued_collective": 2, "last_started_collective": -1,
                               "last_completed_collective": 2}
    (a,) = fr["analysis"]
    assert (a["collective_seq"], a["entry"], a["missing_ranks"], a["collective"], a["state"], a["expected_ranks"]) == (
        5, 4, [1], "nccl:all_reduce", "scheduled", 2)
    assert "rank 1 never joined collective 5" in doc["findings"][0]["message"]


def test_inspector_json_and_prometheus_lines(real_nccl):
    doc = _doc(real_nccl, "inspector_NVIDIA-nccl_README.txt")
    insp = doc["inspector"]
    assert insp["records"] == 2 and insp["n_ranks"] == 8 and insp["format"] == "v4.0"
    (c,) = insp["collectives"]
    assert c["coll"] == "AllReduce" and c["max_busbw_gbps"] == 678.263
    assert c["max_msg_size_bytes"] == 17179869184
    assert doc["hosts"] == ["example-hostname", "nvl72004-T01"]


def test_ib_completion_error_status_explained(real_nccl):
    # Message formats of NCCL's IB completion WARN: pre-2.19 (quoted in the title of the
    # NVIDIA/nccl issue behind nccllog_..._707.txt), 2.19-2.2x, and 2.27+ named statuses.
    base = (real_nccl / "nccllog_NVIDIA-nccl_707.txt").read_text().splitlines()[1]
    prefix = base.split(" NCCL INFO")[0]
    lines = [
        f"{prefix} transport/net_ib.cc:818 NCCL WARN NET/IB : Got completion with error 4, opcode 8983, len 0, vendor err 81",
        f"{prefix} transport/net_ib.cc:1296 NCCL WARN NET/IB : Got completion from peer 10.2.0.5<33092> with error 12, "
        "opcode 0, len 0, vendor err 129 (Recv)",
        f"{prefix} transport/net_ib/p2p.cc:648 NCCL WARN NET/IB: Got completion from peer 10.1.1.4<40554> with "
        "status=IBV_WC_RETRY_EXC_ERR(12) opcode=IBV_WC_RECV_RDMA_WITH_IMM(129) vendor_err=129 hca mlx5_1",
        f"{prefix} NCCL INFO transport/net.cc:1134 -> 6",
    ]
    doc = parse_lines(base.splitlines() + lines)
    f = next(f for f in doc["findings"] if f["id"] == "ib_completion_error")
    assert f["severity"] == "critical" and len(f["evidence"]) == 3
    assert "status 4 = IBV_WC_LOC_PROT_ERR" in f["message"] and "status 12 = IBV_WC_RETRY_EXC_ERR" in f["message"]
    assert "retry counter exceeded" in f["message"] and "10.2.0.5<33092>" in f["message"]
    assert [s["code"] for s in f["details"]["statuses"]] == [4, 12]
    assert f["details"]["vendor_errors"] == [81, 129]


def test_ibv_wc_status_table_is_complete():
    assert sorted(IBV_WC_STATUS) == list(range(24))
    assert IBV_WC_STATUS[5][0] == "IBV_WC_WR_FLUSH_ERR" and IBV_WC_STATUS[13][0] == "IBV_WC_RNR_RETRY_EXC_ERR"
    assert IBV_WC_STATUS[10][0] == "IBV_WC_REM_ACCESS_ERR"


def test_version_mismatch_across_files(real_nccl):
    doc = parse_files([real_nccl / "nccllog_NVIDIA-nccl-tests_131.txt", real_nccl / "nccllog_NVIDIA-nccl-tests_166.txt"])
    assert doc["versions"] == ["2.16.5+cuda11.8", "2.18.3+cuda12.2"]
    f = next(f for f in doc["findings"] if f["id"] == "version_mismatch")
    assert "2.16.5" in f["message"] and len(f["evidence"]) == 2


def test_streaming_keeps_counts_exact_and_evidence_bounded(real_nccl):
    lines = (real_nccl / "nccllog_NVIDIA-nccl_1232.txt").read_text().splitlines()[1:]
    p = NcclLogParser(max_evidence=3)
    for i in range(2000):
        for ln in lines:
            p.feed(ln.replace("node0:", f"node{i % 50}x:"))
    doc = judged(p.result())
    assert doc["lines"] == 2000 * len(lines)
    assert doc["transports"]["by_kind"] == {"NET/Socket": 8 * 2000, "SHM": 2 * 2000}
    f = doc["findings"][0]
    assert f["id"] == "net_socket_fallback" and f["message"].startswith("16000 NCCL connections")
    assert len(f["evidence"]) == 3
    assert len(doc["hosts"]) == 51 and len(doc["transports"]["peers"]) == 4
    assert sum(len(b.lines) for b in p.signals.values()) <= 3 * len(p.signals)


def test_bad_input_is_one_line_per_file(tmp_path, real_nccl):
    empty = tmp_path / "empty.log"
    empty.write_text("")
    junk = tmp_path / "junk.bin"
    junk.write_bytes(bytes(range(256)) * 50)
    foreign = tmp_path / "notes.txt"
    foreign.write_text("hello\nthis is not an NCCL log\n")
    good = tmp_path / "rank1.log.gz"
    good.write_bytes(gzip.compress((real_nccl / "nccllog_NVIDIA-nccl_1412.txt").read_bytes()))
    doc = parse_files([empty, junk, foreign, good])
    assert doc["sources"] == [str(good)]
    errs = {e["source"]: e["error"] for e in doc["errors"]}
    assert errs[str(empty)].endswith("empty.log: empty file")
    assert "junk.bin: binary" in errs[str(junk)]
    assert "unknown format" in errs[str(foreign)]
    assert {f["id"] for f in doc["findings"]} == {"ib_no_gdrdma"}
    with pytest.raises(DiagInputError, match="notes.txt"):
        parse_file(foreign)


# -- the command ------------------------------------------------------------------------------

def _cli(*args):
    return subprocess.run([sys.executable, "-m", "diag", "nccl-log", *map(str, args)], capture_output=True,
                          text=True, timeout=60, cwd=REPO)


def test_cli_text_and_json(real_nccl, tmp_path):
    r = _cli(real_nccl / "nccllog_NVIDIA-nccl-tests_252.txt", real_nccl / "nccllog_NVIDIA-nccl_1232.txt")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "world size: 8" in out and "kolyoz2" in out and "busId d4000" in out
    assert "[critical] net_socket_fallback" in out and "> [0] node0:13571:13571 [0] NCCL INFO Channel 00/0" in out
    r = _cli("--json", real_nccl / "nccllog_NVIDIA-nccl_1612.txt")
    assert r.returncode == 0
    doc = json.loads(r.stdout)
    assert doc["schema"] == SCHEMA and [f["id"] for f in doc["findings"]] == ["socket_error", "init_failure"]


def test_cli_bad_input(real_nccl, tmp_path):
    empty = tmp_path / "empty.log"
    empty.write_text("")
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x00\xff" * 1000)
    r = _cli(empty, junk, real_nccl / "torchlog_OFA-Sys-OFA_271.txt")
    assert r.returncode == 0
    err = r.stderr.strip().splitlines()
    assert err == [f"diag: error: {empty}: empty file", f"diag: error: {junk}: binary data, not a text log"]
    assert "collective_timeout" in r.stdout
    r = _cli(empty)
    assert r.returncode == 2 and r.stderr.strip() == f"diag: error: {empty}: empty file"
    assert "Traceback" not in r.stderr
    r = _cli(real_nccl / "nccltests_NVIDIA-nccl-tests_119.txt")
    assert r.returncode == 2 and "unknown format" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("via,kind,label,finding", [
    ("NET/IB/0/GDRDMA", "NET/IB", "NET/IB/GDRDMA", None),
    ("NET/IB/0(4)/GDRDMA", "NET/IB", "NET/IB/GDRDMA", None),  # PXN through rank 4's NIC
    ("NET/IBext/1/GDRDMA", "NET/IBext", "NET/IBext/GDRDMA", None),
    ("NET/IBext_v8/1", "NET/IBext_v8", "NET/IBext_v8", "ib_no_gdrdma"),
    ("NET/AWS Libfabric/0/GDRDMA", "NET/AWS Libfabric", "NET/AWS Libfabric/GDRDMA", None),
    ("NET/Socket/1", "NET/Socket", "NET/Socket", "net_socket_fallback"),
    ("P2P/CUMEM/read", "P2P/CUMEM", "P2P/CUMEM", None),
    ("P2P/IPC", "P2P/IPC", "P2P/IPC", None),
    ("SHM/direct/direct", "SHM", "SHM", "intra_node_shm"),
])
def test_transport_kinds(real_nccl, via, kind, label, finding):
    # a real 2.18+ transport line with its `via` part replaced by each transport NCCL prints
    line = (real_nccl / "nccllog_NVIDIA-nccl_1412.txt").read_text().splitlines()[2]
    assert line.endswith("via NET/IB/3")
    doc = parse_lines([line[: -len("NET/IB/3")] + via])
    assert doc["transports"]["by_kind"] == {label: 1}
    (peer,) = doc["transports"]["peers"]
    assert (peer["from"], peer["to"], peer["kind"], peer["direction"]) == (5, 12, kind, "send")
    assert peer["pxn"] == ("(" in via)
    ids = {f["id"] for f in doc["findings"]}
    assert ids == ({finding} if finding else set())


def test_tuning_choice_lines(real_nccl):
    prefix = (real_nccl / "nccllog_NVIDIA-nccl_754_tuning_table.txt").read_text().splitlines()[1].split(" NCCL INFO")[0]
    lines = [  # 2.1x numeric ids, then 2.2x names with channel ranges
        f"{prefix} NCCL INFO AllGather: 37756928 Bytes -> Algo 1 proto 2 time 2860.208008",
        f"{prefix} NCCL INFO 1048576 Bytes -> Algo 0 proto 0 time 36.400002",
        f"{prefix} NCCL INFO AllReduce: 4096 Bytes -> Algo Tree proto LL channel{{Lo..Hi}}={{0..1}}",
        f"{prefix} NCCL INFO AllReduce: 8388608 Bytes -> Algo RING proto LL128 channel{{Lo..Hi}}={{0..15}}",
        f"{prefix} NCCL INFO AllReduce: 268435456 Bytes -> Algo RING proto LL128 channel{{Lo..Hi}}={{0..31}}",
    ]
    choices = {(c["op"], c["algo"], c["proto"]): c for c in parse_lines(lines)["tuning"]["choices"]}
    assert choices[("AllGather", "Ring", "Simple")]["calls"] == 1
    assert choices[(None, "Tree", "LL")]["min_bytes"] == 1048576
    ring = choices[("AllReduce", "RING", "LL128")]
    assert (ring["calls"], ring["min_bytes"], ring["max_bytes"], ring["channels"]) == (2, 8388608, 268435456, 32)


def test_summary_sentences_skip_info_findings(real_nccl):
    doc = _doc(real_nccl, "nccllog_NVIDIA-nccl-tests_188.txt")
    assert [f["severity"] for f in doc["findings"]] == ["info"]
    assert summary_sentences(doc["findings"]) == []
    doc = _doc(real_nccl, "nccllog_NVIDIA-nccl_1612.txt")
    assert summary_sentences(doc["findings"]) == ["NCCL lost a socket connection to a peer",
                                            "NCCL communicator initialisation failed"]


def test_overlong_lines_are_cut(tmp_path, real_nccl):
    path = tmp_path / "rank0.log"
    with open(path, "w") as fh:
        fh.write("x" * (3 << 20) + "\n")  # one 3 MB line, e.g. a pasted blob
        fh.write((real_nccl / "nccllog_NVIDIA-nccl_1412.txt").read_text())
    doc = parse_files([path])
    assert doc["transports"]["by_kind"] == {"P2P/direct": 10, "NET/IB": 4}
    assert doc["lines"] == 1 + 15


def test_parallel_ranges_merge_to_the_sequential_result(real_nccl, tmp_path):
    from diag.analyzers.nccl.log_parallel import parse_large_file

    text = "".join(f.read_text() for f in sorted(real_nccl.iterdir()) if f.name.startswith(LOG_PREFIXES))
    path = tmp_path / "job.log"
    path.write_text(text * 40)
    seq = parse_files([path], jobs=1)
    par = judged(parse_large_file(path, max_evidence=5, jobs=3).result())
    for key in ("lines", "nccl_lines", "versions", "hosts", "ranks", "communicators", "transports", "collectives",
                "timeouts", "watchdog", "tuning", "env", "nvls", "channels", "warning_lines", "max_op_count"):
        assert par[key] == seq[key], key
    assert [f["id"] for f in par["findings"]] == [f["id"] for f in seq["findings"]]
    assert par["lines"] == 40 * text.count("\n")


def test_pytorch_desync_report():
    # TORCH_NCCL_DESYNC_DEBUG=1 report lines (format of retrieveDesyncReport in PyTorch)
    lines = [
        "[rank0]:[E ProcessGroupNCCL.cpp:1316] [Rank 0] Watchdog caught collective operation timeout: "
        "WorkNCCL(SeqNum=41207, OpType=ALLREDUCE, NumelIn=1024, NumelOut=1024, Timeout(ms)=600000) ran for 600046 "
        "milliseconds before timing out.",
        " - To our best knowledge, the lagging/dead/mismatched ranks that caused the desync are:",
        "   - [47] joined but didn't finish collective #41207 (count from 1)",
        "     [0, 1, 2] finished collective #41207, but didn't join collective #41208 (count from 1)",
    ]
    doc = parse_lines(lines)
    assert doc["desync_reports"] == [{"kind": "joined_not_finished", "ranks": [47], "seq": 41207},
                                     {"kind": "finished_not_joined", "ranks": [0, 1, 2], "seq": 41208}]
    f = next(f for f in doc["findings"] if f["id"] == "desync")
    assert "rank 47 joined but did not finish collective #41207" in f["message"]
    assert "ranks 0, 1, 2 finished the previous collective but never joined #41208" in f["message"]
    assert {f["id"] for f in doc["findings"]} == {"collective_timeout", "desync"}


def test_warn_location_forms(real_nccl):
    # the real prefixed form, and the location at the start of the message
    real = (real_nccl / "nccllog_NVIDIA-nccl-tests_131.txt").read_text().splitlines()
    warn = next(ln for ln in real if "NCCL WARN" in ln)
    doc = parse_lines([warn, "node1:11:12 [3] NCCL WARN [transport/net_socket.cc:420] Net : Connection refused"])
    locs = {w["location"]: w["message"] for w in doc["warnings"]}
    assert locs["graph/search.cc:890"].startswith("Could not find a path for pattern 4")
    assert locs["transport/net_socket.cc:420"] == "Net : Connection refused"
    assert {f["id"] for f in doc["findings"]} == {"socket_error", "topology_fallback"}


def test_truncated_and_mangled_lines_never_raise(real_nccl):
    # every real line cut at several points (pasted logs are often cut mid-line), plus junk
    lines = [ln for f in sorted(real_nccl.iterdir()) for ln in f.read_text().splitlines()]
    p = NcclLogParser()
    for ln in lines:
        for cut in range(8, len(ln), max(1, len(ln) // 6)):
            p.feed(ln[:cut])
            p.feed(ln[cut:])
    p.feed_all(["NCCL INFO ", "NCCL WARN ", " NCCL INFO Channel", "x NCCL INFO Trees [0]", "{", '"coll": ',
                "WorkNCCL(", "[Rank x] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=a)"])
    doc = judged(p.result())
    assert doc["lines"] > 2 * len(lines) and doc["findings"]
    json.dumps(doc, default=str)


def test_bulk_block_mode_equals_line_by_line(real_nccl, tmp_path):
    # parse_files reads blocks and counts transport/COLL lines in bulk; parse_lines goes line by line
    text = "".join(f.read_text() for f in sorted(real_nccl.iterdir()) if f.name.startswith(LOG_PREFIXES))
    path = tmp_path / "all.log"
    path.write_text(text * 3)
    bulk = parse_files([path], jobs=1)
    lines = parse_lines((text * 3).splitlines())
    for key in ("lines", "nccl_lines", "hosts", "processes", "ranks", "transports", "collectives", "max_op_count",
                "timeouts", "warnings", "env", "channels"):
        assert bulk[key] == lines[key], key
    assert [(f["id"], f["message"]) for f in bulk["findings"]] == [(f["id"], f["message"]) for f in lines["findings"]]


def test_cli_reads_the_nccl_logs_of_a_run_directory(real_nccl, tmp_path):
    from diag.rundir import NCCL, rank_dir_name

    run = tmp_path / "run"
    for rank, name in enumerate(["nccllog_NVIDIA-nccl_1232.txt", "nccllog_NVIDIA-nccl-tests_252.txt"]):
        d = run / rank_dir_name(rank) / NCCL
        d.mkdir(parents=True)
        (d / "nccl.log").write_text((real_nccl / name).read_text())
    (run / rank_dir_name(0) / "rank.json").write_text("{}")
    r = _cli("--json", run)
    assert r.returncode == 0 and r.stderr == ""
    doc = json.loads(r.stdout)
    assert len(doc["sources"]) == 2 and doc["world_size"] == 8
    assert doc["findings"][0]["id"] == "net_socket_fallback"


def test_tuning_choices_in_bulk_mode(real_nccl, tmp_path):
    prefix = (real_nccl / "nccllog_NVIDIA-nccl_754_tuning_table.txt").read_text().splitlines()[1].split(" NCCL INFO")[0]
    lines = [f"{prefix} NCCL INFO AllReduce: {1 << (10 + i % 8)} Bytes -> Algo RING proto LL128 "
             f"channel{{Lo..Hi}}={{0..{i % 4}}}" for i in range(1000)]
    lines += [f"{prefix} NCCL INFO AllGather: 37756928 Bytes -> Algo 1 proto 2 time {i}.5" for i in range(500)]
    path = tmp_path / "tune.log"
    path.write_text("\n".join(lines) + "\n")
    bulk, single = parse_files([path], jobs=1), parse_lines(lines)
    assert bulk["tuning"] == single["tuning"]
    choices = {(c["op"], c["algo"], c["proto"]): c for c in bulk["tuning"]["choices"]}
    ring = choices[("AllReduce", "RING", "LL128")]
    assert (ring["calls"], ring["min_bytes"], ring["max_bytes"], ring["channels"]) == (1000, 1024, 131072, 4)
    assert choices[("AllGather", "Ring", "Simple")]["calls"] == 500
    assert bulk["lines"] == 1500 and bulk["nccl_lines"] == 1500


def test_byte_chunks_in_bulk_equal_line_by_line(real_nccl):
    # feed_bytes counts COLL, transport, TUNING and no-op INFO lines over whole chunks with one
    # regular expression; every other line goes to the per-line parser. Real lines in random
    # order (glued lines, odd prefixes, chains, tables among them), chunk boundaries anywhere.
    import random
    import re

    lines = [ln for f in sorted(real_nccl.iterdir()) if f.name.startswith(LOG_PREFIXES)
             for ln in f.read_text().splitlines()]
    lines += [f"node7:11:12 [3] NCCL INFO AllReduce: {1 << i} Bytes -> Algo RING proto LL128 time 3.5 stream 0x1"
              for i in range(10, 14)]
    rnd = random.Random(7)
    seq = [rnd.choice(lines) for _ in range(6000)]
    ref = parse_lines(seq)
    p = NcclLogParser()
    per_line = []
    feed_all = p.feed_all
    p.feed_all = lambda ls: (per_line.extend(ls), feed_all(ls))
    data = ("\n".join(seq) + "\n").encode()
    pos = 0
    while pos < len(data):
        end = data.rfind(b"\n", pos, pos + rnd.randrange(2000, 40000)) + 1 or len(data)
        p.feed_bytes(data[pos:end])
        pos = end
    assert judged(p.result()) == ref
    bulk = len(seq) - len(per_line)
    assert bulk > 0.2 * len(seq)
    std = re.compile(r"[\w.\-]+:\d+:\d+ \[\d+\] NCCL INFO (?:Channel \d+/\d+ : \d+.* via |\w+: opCount |\w+: \d+ Bytes)")
    assert not [ln for ln in per_line if std.match(ln) and ln.count("NCCL INFO ") == 1]


# NCCL prefixes each line "host:pid:tid [cudaDev]" (its debug.cc); a line that another
# process's output ran into (no newline between them) has that text glued before the host.
GLUED = [
    "node1:4242:4250 [0] NCCL INFO NCCL version 2.18.3+cuda12.2\n",
    "node1:4242:4250 [0] NCCL INFO comm 0x55d1 rank 0 nRanks 2 nNodes 2 localRanks 1 localRank 0 - Init COMPLETE\n",
    "node2:5151:5160 [0] NCCL INFO comm 0x55d1 rank 1 nRanks 2 nNodes 2 localRanks 1 localRank 0 - Init COMPLETE\n",
    "epoch 3 loss 0.125node1:4242:4251 [0] misc/socket.cc:71 NCCL WARN socketProgress: Connection closed by "
    "remote peer node2<36138>\n",
    "2024-05-02T10:00:01.123node2:5151:5161 [0] transport/net_ib.cc:1295 NCCL WARN NET/IB : Got completion "
    "from peer node1 with status=12 opcode=0 len=0 vendor err 129\n",
]


def test_a_host_name_with_text_glued_before_it_is_counted_once():
    doc = parse_lines(GLUED)
    assert doc["hosts"] == ["node1", "node2"] and doc["processes"] == 2 and doc["nodes"] == 2
    assert all(set(w["hosts"]) <= {"node1", "node2"} for w in doc["warnings"])


# NCCL before 2.3 printed "host:pid:tid [dev] INFO msg" and "host:pid:tid [dev] file:line WARN
# msg" without the "NCCL" tag (its include/debug.h), and NCCL 1.x "WARN file:line msg" alone.
PRE_2_3 = [
    "node1:1234:1234 [0] INFO NCCL version 2.2.13+cuda9.0\n",
    "node1:1234:1234 [0] INFO NET : Using interface eth0:10.0.0.1<0>\n",
    "node2:2222:2222 [1] INFO NET : Using interface eth0:10.0.0.2<0>\n",
    "\n",
    "node1:1234:1240 [0] include/common_coll.h:81 WARN Cuda failure 'out of memory'\n",
    "WARN src/core.cu:331 Cuda failure 'out of memory'\n",
    "INFO 2018-01-01 root: not an NCCL line\n",
]


def test_nccl_logs_before_2_3_are_read_and_their_out_of_memory_is_named():
    doc = parse_lines(PRE_2_3)
    assert doc["nccl_version"] == "2.2.13+cuda9.0" and doc["hosts"] == ["node1", "node2"]
    assert doc["nccl_lines"] == 5
    assert sorted(w["location"] for w in doc["warnings"]) == ["include/common_coll.h:81", "src/core.cu:331"]
    oom = next(f for f in doc["findings"] if f["id"] == "cuda_oom_in_nccl")
    assert oom["severity"] == "critical" and "Cuda failure 'out of memory'" in oom["message"]
    assert "first: Cuda failure 'out of memory'" in oom["message"] and len(oom["evidence"]) == 2


# PyTorch's ProcessGroupNCCL raises "NCCL error in: <file>:<line>, <ncclGetErrorString>, NCCL
# version <v>" and adds the error's name and NCCL's last error on the next line.
UNHANDLED = [
    "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1275, "
    "unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.14.3\n",
    "ncclUnhandledCudaError: Call to CUDA function failed.\n",
]


def test_an_unhandled_cuda_error_is_named_and_its_version_kept():
    doc = parse_lines(UNHANDLED)
    assert doc["nccl_version"] == "2.14.3"
    ids = [f["id"] for f in doc["findings"]]
    assert "unhandled_cuda_error" in ids and "nccl_error" in ids
    f = next(f for f in doc["findings"] if f["id"] == "unhandled_cuda_error")
    assert "no WARN line names the CUDA call" in f["message"]
    # With the WARN that says which call failed, and it was out of memory: named as that.
    warn = "node1:77:80 [0] include/alloc.h:48 NCCL WARN Cuda failure 2 'out of memory'\n"
    doc = parse_lines([warn] + UNHANDLED)
    ids = [f["id"] for f in doc["findings"]]
    assert "cuda_oom_in_nccl" in ids and "unhandled_cuda_error" not in ids
