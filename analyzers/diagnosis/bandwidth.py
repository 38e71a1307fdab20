"""Measured bus bandwidth against what the topology should reach: "x% of expected", its
flags and the sentence that names the likely cause.

The facts come from `diag.analyzers.nccl.expected.bandwidth_facts`; the thresholds are
`busbw_bad`, `busbw_healthy`, `busbw_above` and `busbw_small_message_bytes` of the decision
tree. `diag nccl`, the run's `diag nccl` results in the diagnosis and the report all quote
this one judgement.
"""

from __future__ import annotations


def judge(facts: dict, tree) -> dict:
    """The facts with "pct_of_expected", "flags" and "diagnosis" added (a new dict)."""
    out = {**facts, "pct_of_expected": None, "flags": [], "diagnosis": None}
    measured, expected = facts.get("measured_busbw_gbps"), facts.get("expected_busbw_gbps")
    if facts.get("world_size") == 1:
        out["diagnosis"] = ("a single rank: bus bandwidth is 0 by definition (busbw = algbw x 2(n-1)/n for "
                            "all_reduce, x (n-1)/n for the others: 0 at n = 1); run across two or more GPUs")
        return out
    if measured is None:
        out["diagnosis"] = "no measured rows to compare"
        return out
    if facts.get("backend") == "gloo" and expected is None:
        out["diagnosis"] = ("no expected figure: the gloo backend on CPU measures host memory and loopback "
                            "sockets, not GPU links")
        return out
    if expected is None:
        out["diagnosis"] = f"no expected figure: {facts.get('expected_basis')}"
        return out
    th = tree.thresholds
    frac = measured / expected
    out["pct_of_expected"] = 100.0 * frac
    largest = facts.get("largest_size_bytes")
    if largest is not None and largest < th["busbw_small_message_bytes"]:
        out["flags"].append("small_messages")
    if frac < th["busbw_bad"]:
        out["flags"].append("below_50")
    elif frac < th["busbw_healthy"]:
        out["flags"].append("below_80")
    elif frac > th["busbw_above"]:
        out["flags"].append("above_expected")
    out["diagnosis"] = _sentence(frac, facts, th)
    return out


def _sentence(frac: float, f: dict, th: dict) -> str:
    of = f"{100.0 * frac:.0f}% of the expected bus bandwidth"
    multi = f.get("nodes") is not None and f["nodes"] > 1
    low = frac < th["busbw_healthy"]
    if multi and f.get("transport") == "socket" and f.get("inter_kind") in (None, "ib", "roce"):
        return f"inter-node traffic fell back to TCP sockets: {of}"
    if multi and f.get("transport") == "ib" and f.get("gdrdma") is False and low:
        return f"inter-node traffic uses InfiniBand without GPUDirect RDMA (staged through host memory): {of}"
    if f.get("intra_transport") == "shm" and f.get("intra_kind") == "nvlink" and low:
        return f"GPUs exchange data through host shared memory instead of NVLink (P2P disabled?): {of}"
    largest = f.get("largest_size_bytes")
    if frac < th["busbw_bad"]:
        small = largest is not None and largest < th["busbw_small_message_bytes"]
        hint = (f"messages up to only {largest} bytes are too small to reach the link bandwidth" if small
                else "a misconfiguration or congestion: check the transports in NCCL_DEBUG=INFO, "
                     "GPU/NIC affinity and link errors")
        return f"{of}: {hint}"
    if low:
        return f"{of}: below the {th['busbw_healthy']:.0%} a healthy system reaches"
    if frac > th["busbw_above"]:
        return (f"{of}: more than the links allow; the topology given is probably wrong, or in-network "
                "reduction (SHARP, NVLS) is at work")
    return f"{of}: healthy"
