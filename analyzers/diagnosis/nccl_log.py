"""The findings of a parsed NCCL log: each rule is an object holding its stable id,
severity, the short sentence used by the report and the comm-bound diagnosis, its advice
and the check that produces the message and evidence lines.

A check receives the `diag.nccl_log/2` document of facts and its signals (`name -> {"count",
"lines", "messages", "data"}`, as the parser counted them) and returns None or `{"message",
"evidence", "details"?}`. `findings(doc)` is the one reader: a `diag.nccl_log/1` document
(written before the findings moved here) has no signals, and its recorded findings are read
as they were judged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from diag.analyzers.numbers import dict_at

SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}
_EMPTY_SIGNAL = {"count": 0, "lines": [], "messages": [], "data": {}}


@dataclass(frozen=True)
class Rule:
    id: str
    severity: str
    summary: str  # one sentence for the report / comm-bound verdict
    advice: str
    check: Callable[[dict, dict], dict | None]


def _signal(signals: dict, name: str) -> dict:
    b = signals.get(name)
    return b if isinstance(b, dict) else _EMPTY_SIGNAL


def _lines(signals: dict, *names: str, cap: int = 5) -> list[str]:
    out: list[str] = []
    for n in names:
        for line in _signal(signals, n)["lines"]:
            if line not in out:
                out.append(line)
    return out[:cap]


def _count(signals: dict, name: str) -> int:
    return int(_signal(signals, name)["count"] or 0)


def _first_message(signals: dict, name: str) -> str:
    return (_signal(signals, name)["messages"] or [""])[0]


def _ranks_text(ranks: list[int], limit: int = 8) -> str:
    if not ranks:
        return "unknown ranks"
    shown = ", ".join(str(r) for r in ranks[:limit])
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}" + (f" and {len(ranks) - limit} more" if len(ranks) > limit else "")


def _multi_node(doc: dict) -> bool:
    return (doc.get("nodes") or 0) > 1 or any((c.get("nnodes") or 0) > 1 for c in doc["communicators"])


# -- checks --------------------------------------------------------------------------------

def _net_socket(doc, sig):
    n = _count(sig, "via_net_socket")
    if n:
        where = " between nodes" if _multi_node(doc) else ""
        return {"message": f"{n} NCCL connection{'s' if n > 1 else ''} use NET/Socket: traffic goes over TCP "
                           f"sockets{where}, typically several times slower than InfiniBand/RoCE with GPUDirect RDMA",
                "evidence": _lines(sig, "via_net_socket", "ibverbs_missing", "env_NCCL_IB_DISABLE")}
    if _count(sig, "using_network_socket") and _multi_node(doc):
        return {"message": f"NCCL selected the Socket network (TCP) on a job spanning {doc['nodes']} nodes: "
                           "inter-node traffic goes over TCP sockets",
                "evidence": _lines(sig, "using_network_socket", "ibverbs_missing", "env_NCCL_IB_DISABLE")}
    return None


def _ib_no_gdrdma(doc, sig):
    n = _count(sig, "ib_no_gdrdma")
    if not n:
        return None
    return {"message": f"{n} InfiniBand connection{'s' if n > 1 else ''} run without GPUDirect RDMA (no /GDRDMA "
                       "in the transport): network data is staged through host memory",
            "evidence": _lines(sig, "ib_no_gdrdma")}


def _ib_completion(doc, sig):
    n = _count(sig, "ib_completion_error")
    if not n:
        return None
    data = _signal(sig, "ib_completion_error")["data"]
    statuses = data.get("statuses") or []
    expl = "; ".join(f"status {s['code']} = {s['name']}: {s['meaning']}" for s in statuses)
    peers = data.get("peers") or []
    return {"message": f"{n} InfiniBand work completion error{'s' if n > 1 else ''}"
                       + (f" with peer {', '.join(peers[:4])}" if peers else "") + f" ({expl})",
            "evidence": _lines(sig, "ib_completion_error"),
            "details": {"statuses": statuses, "vendor_errors": data.get("vendor", [])}}


def _socket_error(doc, sig):
    n = _count(sig, "socket_error")
    if not n:
        return None
    return {"message": f"{n} socket error{'s' if n > 1 else ''} (connection closed, refused or reset by a peer): "
                       "a peer process died or the network path between the hosts is broken",
            "evidence": _lines(sig, "socket_error")}


def _timeout(doc, sig):
    if not doc["timeouts"]:
        return None
    parts = []
    for t in doc["timeouts"][:4]:
        secs = f"{t['timeout_ms'] / 1000:g} s" if t["timeout_ms"] else "the timeout"
        parts.append(f"{t['op']} SeqNum {t['seq']} did not finish within {secs} on {_ranks_text(t['ranks'])}")
    wd = doc["watchdog"]
    extra = ""
    if wd:
        w = wd[0]
        extra = (f"; watchdog state: stuck at work {w['work']}, last completed {w['last_completed']}, "
                 f"last enqueued {w['last_enqueued']}")
    return {"message": "; ".join(parts) + extra,
            "evidence": _lines(sig, "collective_timeout", "watchdog_state"),
            "details": {"timeouts": doc["timeouts"][:20]}}


def _desync(doc, sig):
    msgs = []
    # Ranks timing out at one sequence number on different operations issued their
    # collectives in different orders: the plainest desync there is.
    ops_at: dict[int, dict[str, set]] = {}
    for t in doc["timeouts"]:
        ops_at.setdefault(t["seq"], {}).setdefault(t["op"], set()).update(t["ranks"])
    for seq, ops in sorted(ops_at.items()):
        if len(ops) > 1:
            msgs.append(f"ranks disagree on the collective at SeqNum {seq}: " + ", ".join(
                f"{_ranks_text(sorted(r))} ran {op}" for op, r in sorted(ops.items()))
                + ", so they issued collectives in different orders")
    # ranks reporting timeouts at different sequence numbers of the same op
    by_seq: dict[int, list[int]] = {}
    for t in doc["timeouts"]:
        by_seq.setdefault(t["seq"], []).extend(t["ranks"])
    if len(by_seq) > 1:
        msgs.append("ranks time out at different sequence numbers: " + "; ".join(
            f"SeqNum {s}: {_ranks_text(sorted(set(r)))}" for s, r in sorted(by_seq.items())))
    groups: dict[str, dict[int, list[int]]] = {}
    for w in doc["watchdog"]:
        groups.setdefault(str(w["pg"]), {}).setdefault(w["last_completed"], []).append(w["rank"])
    for pg, comp in groups.items():
        if len(comp) > 1:
            msgs.append(f"process group {pg}: ranks stopped at different collectives: " + "; ".join(
                f"last completed {c}: {_ranks_text(sorted(r))}" for c, r in sorted(comp.items())))
    for rep in doc["desync_reports"]:
        if rep["kind"] == "joined_not_finished":
            msgs.append(f"{_ranks_text(rep['ranks'])} joined but did not finish collective #{rep['seq']}")
        elif rep["kind"] == "finished_not_joined":
            msgs.append(f"{_ranks_text(rep['ranks'])} finished the previous collective but never joined #{rep['seq']}")
        else:
            msgs.append(f"{_ranks_text(rep['ranks'])} never joined any collective (lagging ranks)")
    fr = doc.get("flight_recorder") or {}
    for a in fr.get("analysis", []):
        if a.get("missing_ranks"):
            msgs.append(f"flight recorder: {_ranks_text(a['missing_ranks'])} never joined collective "
                        f"{a['collective_seq']} ({a.get('collective') or 'unknown op'}, state {a.get('state')})")
    # A desync report where every rank joined and none finished is a hang, not a desync.
    only_all_joined = (msgs and all(r["kind"] == "joined_not_finished" for r in doc["desync_reports"])
                       and len(msgs) == len(doc["desync_reports"]) and len(doc["desync_reports"]) == 1
                       and doc["world_size"] and len(doc["desync_reports"][0]["ranks"]) >= doc["world_size"])
    if not msgs or only_all_joined:
        return None
    return {"message": "; ".join(msgs[:6]),
            "evidence": _lines(sig, "desync_report", "fr_mismatch", "collective_timeout", "watchdog_state")}


def _warn_failure(doc, sig):
    n = _count(sig, "warn_failure")
    if not n:
        return None
    first = _first_message(sig, "warn_failure")
    return {"message": f"{n} NCCL WARN line{'s' if n > 1 else ''} report{'' if n > 1 else 's'} a failure that no "
                       f"other finding explains, first: {first[:200]}",
            "evidence": _lines(sig, "warn_failure")}


def _in_init(chain: dict) -> bool:
    """An error chain through communicator initialisation (init.cc, bootstrap.cc)."""
    return any(f.split(":")[0].endswith(("init.cc", "bootstrap.cc")) for f in chain["frames"])


def _error_chain(doc, sig):
    """An error NCCL returned up its call stack (`file.cc:line -> code`), outside initialisation
    (whose chains are init_failure's)."""
    chains = [c for c in doc["error_chains"] if c["code"] and not _in_init(c)]
    if not chains:
        return None
    c = chains[0]
    more = f" ({len(chains) - 1} more chain{'s' if len(chains) > 2 else ''})" if len(chains) > 1 else ""
    after = f", after the WARN on the same thread: {c['started_by_message']}" if c.get("started_by_message") else ""
    started = [c["started_by"] for c in chains if c.get("started_by")]
    return {"message": f"NCCL returned error {c['code']} ({c['code_name']}) from {c['origin']}, propagated through "
                       f"{len(c['frames'])} frame{'s' if len(c['frames']) > 1 else ''}{after}{more}",
            "evidence": list(dict.fromkeys(started + _lines(sig, "error_chain", "warn_failure")))[:5]}


def _proxy_failure(doc, sig):
    """NCCL's proxy service thread (which sets up and drives a process's network and shared-memory
    connections for its local ranks) failed, named as such with the operation and rank it names."""
    n = _count(sig, "proxy_failure")
    if not n:
        return None
    data = _signal(sig, "proxy_failure")["data"]
    ops, ranks = data.get("operations") or [], data.get("ranks") or []
    what = (f"; it failed to execute {', '.join(ops)} for local {_ranks_text(ranks)}" if ops else "")
    first = _first_message(sig, "proxy_failure")
    return {"message": f"NCCL's proxy service failed ({n} WARN line{'s' if n > 1 else ''}, first: {first}){what}",
            "evidence": _lines(sig, "proxy_failure"),
            "details": {"operations": ops, "ranks": ranks}}


def _init_failure(doc, sig):
    n = _count(sig, "init_failure")
    if not n:
        return None
    chains = [c for c in doc["error_chains"] if _in_init(c)]
    msg = "communicator initialisation failed"
    if chains:
        c = chains[0]
        msg += (f": error {c['code']} ({c['code_name']}) raised at {c['origin']} and propagated through "
                f"{len(c['frames'])} frames")
    return {"message": msg, "evidence": _lines(sig, "init_failure", "socket_error", "error_chain")}


def _nccl_error(doc, sig):
    n = _count(sig, "nccl_error") + _count(sig, "cuda_failure")
    if not n:
        return None
    return {"message": f"{n} NCCL/CUDA error line{'s' if n > 1 else ''} reported by the application or nccl-tests",
            "evidence": _lines(sig, "nccl_error", "cuda_failure")}


def _cuda_oom(doc, sig):
    n = _count(sig, "cuda_oom")
    if not n:
        return None
    first = _first_message(sig, "cuda_oom")
    return {"message": f"NCCL could not allocate device memory ({n} WARN line{'s' if n > 1 else ''}, first: "
                       f"{first[:200]})", "evidence": _lines(sig, "cuda_oom", "unhandled_cuda_error", "nccl_error")}


def _unhandled_cuda(doc, sig):
    n = _count(sig, "unhandled_cuda_error")
    if not n or _count(sig, "cuda_oom"):
        return None  # out of memory names the CUDA error already
    failed = _first_message(sig, "cuda_failure")
    why = f"; the CUDA call that failed: {failed[:200]}" if failed else \
        "; no WARN line names the CUDA call that failed (the log was taken without NCCL_DEBUG=WARN)"
    return {"message": f"NCCL returned an unhandled CUDA error (ncclUnhandledCudaError; {n} line{'s' if n > 1 else ''})"
                       + why, "evidence": _lines(sig, "unhandled_cuda_error", "cuda_failure")}


def _version_mismatch(doc, sig):
    base = {v.split("+")[0].split("-")[0] for v in doc["versions"]}
    if len(base) < 2:
        return None
    return {"message": "processes run different NCCL versions: " + ", ".join(doc["versions"]),
            "evidence": _lines(sig, "version")}


def _ib_error(doc, sig):
    n = _count(sig, "ib_error")
    if not n:
        return None
    return {"message": f"{n} InfiniBand error{'s' if n > 1 else ''} reported by the NET/IB transport",
            "evidence": _lines(sig, "ib_error")}


def _p2p_disabled(doc, sig):
    env = doc["env"]
    why = []
    if env.get("NCCL_P2P_DISABLE", "0") not in ("0", ""):
        why.append(f"NCCL_P2P_DISABLE={env['NCCL_P2P_DISABLE']}")
    level = env.get("NCCL_P2P_LEVEL")
    if level is not None and level.upper() in ("LOC", "0"):
        why.append(f"NCCL_P2P_LEVEL={level}")
    if not why:
        return None
    return {"message": "peer-to-peer GPU transfers are disabled by the environment (" + ", ".join(why)
                       + "): GPUs in a node exchange data through host memory",
            "evidence": _lines(sig, "env_NCCL_P2P_DISABLE", "env_NCCL_P2P_LEVEL")}


def _intra_shm(doc, sig):
    n = _count(sig, "via_shm")
    if not n:
        return None
    return {"message": f"{n} connection{'s' if n > 1 else ''} between GPUs of the same node go through host shared "
                       "memory (SHM) instead of P2P over NVLink/PCIe",
            "evidence": _lines(sig, "via_shm")}


def _ib_disabled(doc, sig):
    v = doc["env"].get("NCCL_IB_DISABLE")
    if v in (None, "0", ""):
        return None
    return {"message": f"InfiniBand is disabled by the environment (NCCL_IB_DISABLE={v})",
            "evidence": _lines(sig, "env_NCCL_IB_DISABLE")}


def _ibverbs_missing(doc, sig):
    n = _count(sig, "ibverbs_missing")
    if not n:
        return None
    return {"message": "libibverbs could not be loaded, so NCCL cannot use InfiniBand/RoCE and uses TCP sockets "
                       "for any traffic between nodes",
            "evidence": _lines(sig, "ibverbs_missing")}


def _ib_no_device(doc, sig):
    if not _count(sig, "ib_no_device"):
        return None
    return {"message": "NET/IB found no usable InfiniBand/RoCE device", "evidence": _lines(sig, "ib_no_device")}


def _nvls_unavailable(doc, sig):
    n = doc["nvls"]["unavailable_devices"]
    if not n:
        return None
    return {"message": f"NVLink SHARP (NVLS) multicast is not available on {n} device{'s' if n > 1 else ''}: "
                       "NCCL cannot offload reductions to the NVSwitch",
            "evidence": _lines(sig, "nvls_unavailable")}


def _nvls_unused(doc, sig):
    if not doc["nvls"]["available_devices"] or doc["nvls"]["channels"] != 0:
        return None
    return {"message": "NVLS multicast is available but NCCL built 0 NVLS channels",
            "evidence": _lines(sig, "nvls_available")}


def _algo_forced(doc, sig):
    forced = {k: v for k, v in doc["env"].items() if k in ("NCCL_ALGO", "NCCL_PROTO")}
    if not forced:
        return None
    return {"message": "the algorithm/protocol choice is forced by the environment ("
                       + ", ".join(f"{k}={v}" for k, v in forced.items())
                       + "): NCCL cannot pick a faster one per message size",
            "evidence": _lines(sig, "env_NCCL_ALGO", "env_NCCL_PROTO")}


_ROLE_TEXT = {"bootstrap": "its bootstrap", "socket": "socket connections", "oob": "InfiniBand's setup (OOB)"}


def _virtual_interface(doc, sig):
    """An interface other nodes cannot route to (a container bridge, a tunnel, the loopback)
    among those NCCL chose, quoted with the interface to name instead."""
    chosen = (doc.get("transports") or {}).get("interfaces") or []
    bad = [(i, kind) for i in chosen if (kind := i.get("kind"))]
    if not bad:
        return None
    names = list(dict.fromkeys(i["name"] for i, _ in bad))
    usable = list(dict.fromkeys(i["name"] for i in chosen if i["name"] not in names))
    uses = "; ".join(f"{_ROLE_TEXT.get(role, role)} on " + ", ".join(
        f"{i['name']} ({kind}, {i['address']})" for i, kind in bad if i["role"] == role)
        for role in dict.fromkeys(i["role"] for i, _ in bad))
    multi = _multi_node(doc)
    consequence = ("other nodes cannot reach it, or only through a slow path" if multi else
                   "harmless while every rank is on this node, a hang or a slow path once the job spans nodes")
    name_it = (f"NCCL_SOCKET_IFNAME={','.join(usable)}" if usable
               else "NCCL_SOCKET_IFNAME=<the interface the nodes reach each other on>")
    current = (doc.get("env") or {}).get("NCCL_SOCKET_IFNAME")
    advice = (f"Set {name_it}, or exclude {'it' if len(names) == 1 else 'them'} with "
              f"NCCL_SOCKET_IFNAME=^{','.join(names)}"
              + (f" (it is now {current!r}, which still lets NCCL choose {', '.join(names)})" if current else "")
              + ("; for the bootstrap, MASTER_ADDR must be an address of that interface too"
                 if any(i["role"] == "bootstrap" for i, _ in bad) else "") + ".")
    return {"message": f"NCCL uses {uses}: {consequence}", "advice": advice,
            "severity": "warning" if multi else "info",
            "evidence": list(dict.fromkeys(i["line"] for i, _ in bad))[:5],
            "details": {"interfaces": [{**{k: i[k] for k in ("role", "name", "address")}, "kind": kind}
                                       for i, kind in bad]}}


def _simple(signal: str, message: str):
    def check(doc, sig):
        if not _count(sig, signal):
            return None
        return {"message": message, "evidence": _lines(sig, signal)}
    return check


RULES: list[Rule] = [
    Rule("net_socket_fallback", "critical", "NCCL fell back to TCP sockets between nodes",
         "Make InfiniBand/RoCE usable: install rdma-core (libibverbs) and the NIC driver in the container, "
         "unset NCCL_IB_DISABLE, check NCCL_IB_HCA and NCCL_SOCKET_IFNAME; on AWS install the aws-ofi-nccl "
         "plugin for EFA.", _net_socket),
    Rule("ib_completion_error", "critical", "InfiniBand reported work completion errors",
         "Find the first failing link or peer: check `ibstat`, cables and switch port counters, the peer "
         "process's own log, and NCCL_IB_TIMEOUT / NCCL_IB_RETRY_CNT; status 4/10 point at GPUDirect RDMA "
         "memory registration (nvidia-peermem, dmabuf).", _ib_completion),
    Rule("socket_error", "critical", "NCCL lost a socket connection to a peer",
         "Look for the first rank that died (OOM, exception, killed) in its own log; otherwise check "
         "firewalls and that NCCL_SOCKET_IFNAME selects an interface every host can reach.", _socket_error),
    # Before the plain timeout: when ranks disagree, that is what the user needs first.
    Rule("desync", "critical", "ranks are stuck at different collectives (desync)",
         "The ranks' control flow diverged: find the branch that makes one rank call a different collective, "
         "or skip one (a rank-dependent `if` around all_reduce/barrier/broadcast, an early exit or an extra "
         "evaluation step on one rank, uneven numbers of batches per rank, a model built differently on some "
         "ranks). Make every rank call the same collectives in the same order; TORCH_NCCL_DESYNC_DEBUG=1 and "
         "the flight recorder name the first divergent call.", _desync),
    Rule("collective_timeout", "critical", "a collective timed out in the PyTorch watchdog",
         "A rank stopped calling collectives or a link hung. Set TORCH_NCCL_DESYNC_DEBUG=1 / the flight "
         "recorder (TORCH_NCCL_TRACE_BUFFER_SIZE) to find the lagging rank; check for data-dependent control "
         "flow, uneven batches, or one slow rank (I/O, checkpointing).", _timeout),
    Rule("init_failure", "critical", "NCCL communicator initialisation failed",
         "Check that every rank can reach the bootstrap address (MASTER_ADDR/port, NCCL_SOCKET_IFNAME), "
         "that all ranks started, and the first WARN line of the error chain.", _init_failure),
    Rule("cuda_oom_in_nccl", "critical", "NCCL ran out of device memory",
         "NCCL allocates its buffers and channels on the device when a communicator starts and when a new "
         "algorithm is first used: leave it room (a smaller micro-batch, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, "
         "torch.cuda.set_per_process_memory_fraction below 1), or make NCCL take less (NCCL_BUFFSIZE smaller than its "
         "4 MiB default, NCCL_NVLS_ENABLE=0, fewer communicators); check that no other process holds memory on the GPU "
         "(nvidia-smi).", _cuda_oom),
    Rule("unhandled_cuda_error", "critical", "a CUDA call inside NCCL failed (unhandled cuda error)",
         "Read the first WARN line with a Cuda failure on the failing rank (rerun with NCCL_DEBUG=WARN if there is "
         "none): out of memory is the most common; an earlier error on the device (an illegal memory access in a "
         "kernel: rerun with CUDA_LAUNCH_BLOCKING=1), a driver older than the CUDA runtime, or a GPU fault "
         "(Xid errors in dmesg) are the others.", _unhandled_cuda),
    Rule("nccl_error", "critical", "NCCL or CUDA returned an error",
         "Re-run with NCCL_DEBUG=INFO (and NCCL_DEBUG_SUBSYS=INIT,NET) and read the first WARN line.", _nccl_error),
    Rule("proxy_failure", "critical", "NCCL's proxy service thread failed",
         "The proxy thread sets up and drives each process's network and shared-memory connections for its "
         "local ranks, so its failures are usually a consequence: the local rank it names exited, crashed or "
         "timed out first (read that rank's own log and the first WARN across all ranks); an accept that fails "
         "with \"Resource temporarily unavailable\" means the connecting rank closed its end before the proxy "
         "took it. Otherwise check that local ranks share one container or network namespace (their proxy "
         "sockets must reach each other) and the open-files limit (`ulimit -n`).", _proxy_failure),
    Rule("error_chain", "critical", "NCCL returned an error up its call stack",
         "Read the first WARN line before the chain: it names the failing operation; the chain's innermost "
         "frame is where NCCL gave up.", _error_chain),
    Rule("warn_failure", "warning", "NCCL warned about a failure",
         "Read the quoted WARN lines and the lines just before them in the same process's log; a failure "
         "NCCL recovered from can still slow the job or precede a hang.", _warn_failure),
    Rule("version_mismatch", "critical", "processes run different NCCL versions",
         "Use one NCCL build on every node (same container image / wheel).", _version_mismatch),
    Rule("socket_virtual_interface", "warning", "NCCL chose a network interface other nodes cannot route to",
         "Set NCCL_SOCKET_IFNAME to the interface the nodes reach each other on.", _virtual_interface),
    Rule("ib_error", "warning", "the InfiniBand transport reported errors",
         "Check the HCA state (`ibstat`, `ibv_devinfo`), firmware and dmesg on the reporting host.", _ib_error),
    Rule("ib_no_gdrdma", "warning", "InfiniBand runs without GPUDirect RDMA",
         "Load nvidia-peermem (or use dmabuf with a recent driver/kernel), check NCCL_NET_GDR_LEVEL and that "
         "GPU and NIC share a PCIe switch.", _ib_no_gdrdma),
    Rule("ib_disabled", "warning", "InfiniBand is disabled by NCCL_IB_DISABLE",
         "Unset NCCL_IB_DISABLE unless the nodes really have no InfiniBand/RoCE.", _ib_disabled),
    Rule("p2p_disabled", "warning", "GPU peer-to-peer is disabled by the environment",
         "Unset NCCL_P2P_DISABLE / NCCL_P2P_LEVEL unless P2P is broken on this platform (check ACS/IOMMU "
         "settings with `nvidia-smi topo -p2p r`).", _p2p_disabled),
    Rule("intra_node_shm", "warning", "GPUs in one node talk through host shared memory instead of P2P",
         "P2P is unavailable between these GPUs (PCIe ACS, IOMMU, virtualisation or NCCL_P2P_DISABLE); "
         "check `nvidia-smi topo -m` and disable ACS for bare-metal servers.", _intra_shm),
    Rule("ibverbs_missing", "warning", "libibverbs is missing, so NCCL cannot use InfiniBand/RoCE",
         "Install rdma-core/libibverbs (and mount /dev/infiniband into containers).", _ibverbs_missing),
    Rule("cuda_library_missing", "warning", "NCCL could not find the CUDA driver library",
         "Make libcuda.so visible (driver install, container runtime, NCCL_CUDA_PATH).",
         _simple("cuda_library_missing", "NCCL could not load libcuda.so (CUDA driver library)")),
    Rule("rocm_iommu", "warning", "the kernel command line lacks iommu=pt (RCCL)",
         "Add iommu=pt to the kernel command line on AMD GPU hosts, as RCCL recommends.",
         _simple("rocm_iommu", "RCCL warns that \"iommu=pt\" is missing from the kernel command line, "
                               "which can make the system unstable or hang")),
    Rule("nvls_unused", "warning", "NVLS is available but unused",
         "Check NCCL_NVLS_ENABLE and the fabric manager / IMEX service.", _nvls_unused),
    Rule("ib_no_device", "info", "NCCL found no InfiniBand device",
         "Expected on hosts without InfiniBand/RoCE; otherwise check the RDMA driver and NCCL_IB_HCA.", _ib_no_device),
    Rule("nvls_unavailable", "info", "NVLink SHARP is unavailable",
         "Expected without NVSwitch multicast (pre-Hopper or no fabric manager); on HGX H100/H200 check the "
         "fabric manager and CUDA driver.", _nvls_unavailable),
    Rule("algo_forced", "info", "the NCCL algorithm or protocol is forced by the environment",
         "Unset NCCL_ALGO / NCCL_PROTO after experimenting; the defaults pick per message size.", _algo_forced),
    Rule("topology_fallback", "info", "NCCL's topology search fell back to a simple order",
         "Usually harmless on small PCIe systems; check `nvidia-smi topo -m` and NCCL_P2P_LEVEL.",
         _simple("topology_fallback", "NCCL could not find a path for a ring/tree pattern and fell back to a "
                                      "simple order (the topology search found no better graph)")),
]

RULES_BY_ID = {r.id: r for r in RULES}


def _evaluate(doc: dict) -> list[dict]:
    """Findings in rule order, most severe first."""
    signals = dict_at(doc, "signals")
    out = []
    for rule in RULES:
        res = rule.check(doc, signals)
        if not res:
            continue
        # A check may sharpen the rule's severity and advice with what it found (names, values).
        f = {"id": rule.id, "severity": res.get("severity", rule.severity), "message": res["message"],
             "evidence": res["evidence"], "summary": rule.summary, "advice": res.get("advice", rule.advice)}
        if res.get("details"):
            f["details"] = res["details"]
        out.append(f)
    out.sort(key=severity_rank)
    return out


def findings(doc: dict) -> list[dict]:
    """The findings of a diag.nccl_log document, most severe first; a /1 document's as recorded."""
    if "signals" in doc:
        return _evaluate(doc)
    return [f for f in doc.get("findings") or [] if isinstance(f, dict)]


def judged(doc: dict) -> dict:
    """The document with its findings, as `diag nccl-log` and `diag run` show it."""
    return {**doc, "findings": findings(doc)}


def severity_rank(finding: dict) -> int:
    """0 for the most severe finding (SEVERITY_ORDER), after every known severity for an unknown one."""
    return SEVERITY_ORDER.get(str(finding.get("severity")), len(SEVERITY_ORDER))


def summary_sentences(found: list[dict], max_sentences: int = 5, min_severity: str = "warning") -> list[str]:
    """The report's and comm-bound verdict's short sentences for the findings of a log, most
    severe first, e.g. "NCCL fell back to TCP sockets between nodes"."""
    limit = SEVERITY_ORDER[min_severity]
    out = []
    for f in sorted(found, key=severity_rank):
        if severity_rank(f) > limit:
            continue
        rule = RULES_BY_ID.get(str(f.get("id")))
        sentence = f.get("summary") or (rule.summary if rule else f.get("message", ""))
        if sentence and sentence not in out:
            out.append(sentence)
    return out[:max_sentences]
