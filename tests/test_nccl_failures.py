"""NCCL logs: every WARN that reports a failure is a finding, error chains outside initialisation
are findings, and ranks that time out at one sequence number on different collectives are a desync."""

from __future__ import annotations

from conftest import FIXTURES

from diag.analyzers.diagnosis.nccl_log import judged
from diag.analyzers.nccl import log as nccl_log


def parse_files(paths: list) -> dict:
    """The parsed logs as `diag nccl-log` shows them: facts and the diagnosis's findings."""
    return judged(nccl_log.parse_files(paths))


# Real lines from an RCCL issue report (UCX net plugin with GPUDirect RDMA, two nodes; reporter
# clearsky07, July 2024), with their build paths shortened. Only WARN lines and one error
# chain outside initialisation: the log once ended in "No problems found."
RCCL_UCX = """\
node02:10366:10377 [0] ucx_plugin.c:498 NCCL WARN Failed: UCX error ucx_plugin.c:498 '-5' Invalid parameter
node02:10366:10377 [0] NCCL INFO src/transport/net.cc:858 -> 3
node02:10366:10377 [0] NCCL INFO src/proxy.cc:1311 -> 3
node02:10366:10377 [0] NCCL INFO src/proxy.cc:1382 -> 3
node02:10366:10377 [0] src/proxy.cc:1524 NCCL WARN [Proxy Service 1] Failed to execute operation Connect from rank 1, retcode 3
node02:10366:10376 [0] src/proxy.cc:1148 NCCL WARN Socket recv failed while polling for opId=0x147999b41d80
"""

# The PyTorch watchdog's own layout (ProcessGroupNCCL.cpp), as in the real logs of ../shared/data:
# rank 0 waits in a BROADCAST and rank 1 in an ALLREDUCE, both the group's 5th collective.
WATCHDOG = """\
[E ProcessGroupNCCL.cpp:737] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=BROADCAST, Timeout(ms)=600000) ran for 600134 milliseconds before timing out.
[E ProcessGroupNCCL.cpp:737] [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, Timeout(ms)=600000) ran for 600127 milliseconds before timing out.
"""


def _doc(tmp_path, text, name="x.log"):
    (tmp_path / name).write_text(text)
    return parse_files([str(tmp_path / name)])


def test_failure_warns_and_an_error_chain_are_findings(tmp_path):
    doc = _doc(tmp_path, RCCL_UCX)
    by_id = {f["id"]: f for f in doc["findings"]}
    assert set(by_id) == {"error_chain", "warn_failure", "proxy_failure"}, sorted(by_id)
    chain = by_id["error_chain"]
    assert chain["severity"] == "critical"
    assert chain["message"].startswith("NCCL returned error 3 (ncclInternalError) from src/transport/net.cc:858")
    # The chain is tied to the WARN on its thread (10366:10377) that it followed.
    assert chain["message"].endswith("after the WARN on the same thread: Failed: UCX error ucx_plugin.c:498 '-5' "
                                     "Invalid parameter")
    assert chain["evidence"][0] == RCCL_UCX.splitlines()[0]
    warn = by_id["warn_failure"]
    assert warn["message"].startswith("1 NCCL WARN line reports a failure") and "UCX error" in warn["message"]
    # The proxy thread's two WARN lines (proxy.cc) are named as its own failure.
    proxy = by_id["proxy_failure"]
    assert proxy["details"] == {"operations": ["Connect"], "ranks": [1]}
    assert proxy["evidence"] == RCCL_UCX.splitlines()[4:6]


def test_a_plugin_lookup_warning_is_not_a_failure(tmp_path):
    doc = _doc(tmp_path, "h:1:1 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so\n"
                         "h:1:1 [0] NCCL WARN NET/Plugin: Failed to find ncclNetPlugin_v6 symbol.\n")
    assert doc["findings"] == []


def test_ranks_on_different_collectives_at_one_seqnum_are_a_desync(tmp_path):
    doc = _doc(tmp_path, WATCHDOG)
    ids = [f["id"] for f in doc["findings"]]
    assert ids[0] == "desync" and "collective_timeout" in ids
    desync = doc["findings"][0]
    assert "at SeqNum 5: rank 1 ran ALLREDUCE, rank 0 ran BROADCAST" in desync["message"]
    assert "different orders" in desync["message"]
    assert "control flow" in desync["advice"]
    # The same operation on both ranks is a plain timeout, not a desync.
    same = _doc(tmp_path, WATCHDOG.replace("BROADCAST", "ALLREDUCE"), "same.log")
    assert [f["id"] for f in same["findings"]] == ["collective_timeout"]


def test_a_proxy_accept_failure_is_named_and_starts_its_error_chain():
    """NVIDIA/nccl issue 1610: the proxy's accept fails with EAGAIN, then error chains on two ranks."""
    doc = parse_files([str(FIXTURES / "nccl" / "nccllog_NVIDIA-nccl_1610_proxy_accept.txt")])
    by_id = {f["id"]: f for f in doc["findings"]}
    assert set(by_id) == {"proxy_failure", "error_chain"}  # no longer a bare "read the first WARN line"
    proxy = by_id["proxy_failure"]
    assert "first: [Service thread] Accept failed Resource temporarily unavailable" in proxy["message"]
    assert proxy["details"] == {"operations": ["Close"], "ranks": [0]}
    assert "connecting rank closed its end" in proxy["advice"]
    chains = {tuple(c["frames"]): c for c in doc["error_chains"]}
    assert "[Service thread] Accept failed" in chains[("misc/socket.cc:826",)]["started_by"]
    # Rank 7's chains follow no WARN of their own threads in this log.
    assert [c["started_by"] for k, c in chains.items() if len(k) > 1] == [None, None]


def test_exit_statuses_say_a_failed_test_and_asked_for_findings(real_nccl, capsys):
    """`diag nccl parse` of an output whose test failed exits 1, as `diag nccl` running it does;
    `diag nccl-log` exits 1 on a critical finding only when asked (--fail-on), 0 otherwise."""
    from diag import cli
    from diag.analyzers.nccl import nccl_tests

    failed = real_nccl / "nccltests_NVIDIA-nccl-tests_15.txt"
    assert [t["status"] for t in nccl_tests.parse_file(failed)["tests"]] == ["failed"]
    assert cli.main(["nccl", "parse", str(failed)]) == 1
    ok = next(p for p in sorted(real_nccl.glob("nccltests_*.txt"))
              if all(t["status"] == "ok" for t in nccl_tests.parse_file(p)["tests"]))
    assert cli.main(["nccl", "parse", str(ok)]) == 0
    log = real_nccl / "nccllog_NVIDIA-nccl_226.txt"
    assert cli.main(["nccl-log", str(log)]) == 0
    assert cli.main(["nccl-log", str(log), "--fail-on", "critical"]) == 1
    assert "[critical]" in capsys.readouterr().out
    quiet = real_nccl / "nccllog_NVIDIA-nccl-tests_29.txt"
    assert cli.main(["nccl-log", str(quiet), "--fail-on", "critical"]) == 0
