"""The failure side of the NCCL log parser: WARN lines and their `file.cc:line -> code`
error chains, and the lines that are not NCCL's own: PyTorch watchdog timeouts and desync
reports, flight-recorder dumps, NCCL Inspector JSON and its Prometheus output.
"""

from __future__ import annotations

import json
import re
from typing import Any

from diag.analyzers.nccl.ib_status import ib_status_by_name, nccl_result
from diag.analyzers.nccl.log_collectives import coll
from diag.analyzers.nccl.log_grammar import (
    _DESYNC_FINISHED,
    _DESYNC_JOINED,
    _DESYNC_LAGGING,
    _FR_KEYS,
    _FR_MISSING,
    _FR_NOT_ALL,
    _IB_COMPLETION,
    _INSPECTOR_KEYS,
    _JSON_KV,
    _LOC_END,
    _LOC_START,
    _PROM,
    _PROM_LABEL,
    _PROXY_OP,
    _RAN_FOR,
    _RANK_TAG,
    _SOCKET_WORDS,
    _VERSION,
    _WARN_BENIGN,
    _WARN_FAILURE,
    _WATCHDOG,
    _WD_STATE,
    _WORK_KV,
    MAX_CACHE,
    MAX_CHAINS,
    MAX_RANKS,
    MAX_SET,
    MAX_WARN_KINDS,
    PREFIX_SPAN,
    _ranks_list,
    json_value,
)
from diag.analyzers.nccl.log_state import LogState

# What an application or nccl-tests prints when NCCL returned an error.
_ERROR_WORDS = re.compile(r"NCCL error|DistBackendError|nccl(?:System|Remote|Internal|UnhandledCuda)Error|"
                          r"NCCL failure")
# A CUDA allocation NCCL made that failed for want of device memory ("Cuda failure 'out of
# memory'", "Cuda failure 2 'out of memory'", "Failed to CUDA calloc 6291456 bytes", cuMem* calls
# returning CUDA_ERROR_OUT_OF_MEMORY).
_OUT_OF_MEMORY = re.compile(r"out of memory|OUT_OF_MEMORY|Failed to CUDA (?:c|m)alloc|hipErrorOutOfMemory", re.I)


def chain(p: LogState, line: str, pfx: tuple, m: re.Match) -> None:
    file, lineno, code, rest = m.groups()
    tkey = (pfx[0], pfx[1], pfx[2], pfx[3])
    frames = p.open_chain.get(tkey)
    if frames is None:
        if len(p.open_chain) >= MAX_CACHE:
            p.open_chain.clear()
            p.chain_warn.clear()
        frames = p.open_chain[tkey] = []
        warn = p.last_warn.pop(tkey, None)
        if warn is not None:
            p.chain_warn[tkey] = warn
    if len(frames) < 64:
        frames.append((f"{file}:{lineno}", int(code), "[Async thread]" in rest or "[Proxy Thread]" in rest))
    b = p.signal("error_chain", line)
    b.data["last_code"] = int(code)
    if file.endswith(("init.cc", "bootstrap.cc")) or file.startswith("init"):
        p.signal("init_failure", line)


def close_chains(p: LogState) -> None:
    for tkey, frames in p.open_chain.items():
        record_chain(p, frames, p.chain_warn.get(tkey))
    p.open_chain.clear()
    p.chain_warn.clear()


def end_chain(p: LogState, tkey: tuple) -> None:
    frames = p.open_chain.pop(tkey, None)
    if frames is not None:
        record_chain(p, frames, p.chain_warn.pop(tkey, None))


def record_chain(p: LogState, frames: list, warn: str | None) -> None:
    """One finished `file.cc:line -> code` chain (innermost frame first), counted by its frames,
    with the WARN line on the same thread that it followed (None: no WARN started it here)."""
    if not frames:
        return
    key = tuple(f for f, _, _ in frames)
    c = p.chains.get(key)
    if c is None:
        if len(p.chains) >= MAX_CHAINS:
            return
        code = frames[0][1]
        c = p.chains[key] = {"code": code, "code_name": nccl_result(code)["name"], "frames": list(key),
                                "origin": key[0], "async": any(a for _, _, a in frames), "count": 0,
                                "started_by": warn}
    elif c["started_by"] is None:
        c["started_by"] = warn
    c["count"] += 1


# -- NCCL WARN -------------------------------------------------------------------------
def warn(p: LogState, line: str, pre: str, msg: str) -> None:
    p.warn_total += 1
    pfx = p.prefix(pre)
    loc = pfx[4]
    if loc is None:
        # location after odd prefixes, or at the start of the message ("[file.cc:12] ...")
        # (on the ends only: "\S+\." searched along a long run of non-blanks is quadratic)
        m = _LOC_END.search(pre[-PREFIX_SPAN:]) or _LOC_START.match(msg[:PREFIX_SPAN])
        loc = m.group(1) if m else None
        if m is not None and m.re is _LOC_START:
            msg = msg[m.end():]
    short = loc.split("/src/", 1)[-1] if loc else None
    kind = short or re.sub(r"\d+", "N", msg[:60])
    w = p.warn_kinds.get(kind)
    if w is None:
        if len(p.warn_kinds) >= MAX_WARN_KINDS:
            kind = "other"
            w = p.warn_kinds.get(kind)
        if w is None:
            w = p.warn_kinds[kind] = {"kind": kind, "location": short, "message": msg[:300], "count": 0,
                                         "hosts": [], "evidence": []}
    w["count"] += 1
    if pfx[0] and pfx[0] not in w["hosts"] and len(w["hosts"]) < 64:
        w["hosts"].append(pfx[0])
    if len(w["evidence"]) < p.cap:
        w["evidence"].append(line[:1000])
    # a WARN ends the thread's open error chain and may start the next one
    tkey = (pfx[0], pfx[1], pfx[2], pfx[3])
    end_chain(p, tkey)
    if len(p.last_warn) >= MAX_CACHE:
        p.last_warn.clear()
    p.last_warn[tkey] = line[:1000]
    classify_warn(p, line, msg, short)


def classify_warn(p: LogState, line: str, msg: str, loc: str | None) -> None:
    if "Got completion" in msg:
        m = _IB_COMPLETION.search(msg)
        if m:
            peer, sname, code, opcode, vendor = m.groups()
            code = int(code)
            if sname and ib_status_by_name(sname) is not None:
                code = ib_status_by_name(sname)
            p.signal("ib_completion_error", line, statuses=[code], peers=[peer] if peer else None,
                        vendor=[int(vendor)] if vendor else None)
            return
    if (loc or "").rsplit("/", 1)[-1].startswith("proxy.cc") or "[Proxy Service" in msg or "[Service thread]" in msg:
        m = _PROXY_OP.search(msg)
        p.signal("proxy_failure", line, operations=[m.group(1)] if m else None,
                    ranks=[int(m.group(2))] if m else None)
        return
    if ("socket" in (loc or "")) or any(w in msg for w in _SOCKET_WORDS):
        p.signal("socket_error", line)
        if "bootstrap" in msg.lower():
            p.signal("init_failure", line)
        return
    if "libibverbs" in msg:
        p.signal("ibverbs_missing", line)
    elif "iommu" in msg:
        p.signal("rocm_iommu", line)
    elif "Failed to find CUDA library" in msg or "libcuda" in msg:
        p.signal("cuda_library_missing", line)
    elif "Could not find a path" in msg or "falling back" in msg or "graph/search.cc" in (loc or ""):
        # (the topology search's own warnings, also when a pasted log cut the line short)
        p.signal("topology_fallback", line)
    elif "async fatal event" in msg or "NET/IB" in msg:
        p.signal("ib_error", line)
    elif _OUT_OF_MEMORY.search(msg):
        p.signal("cuda_oom", line)
    elif "Cuda failure" in msg or "CUDA failure" in msg or "Hip failure" in msg:
        p.signal("cuda_failure", line)
    elif loc and (loc.endswith(("init.cc", "bootstrap.cc")) and ("fail" in msg.lower() or "error" in msg.lower())):
        p.signal("init_failure", line)
    elif "Timeout" in msg or "timeout" in msg:
        p.signal("nccl_timeout_warn", line)
    elif _WARN_FAILURE.search(msg) and not _WARN_BENIGN.search(msg):
        p.signal("warn_failure", line)  # a failure no specific rule names: still reported


# -- lines without an NCCL INFO/WARN tag ----------------------------------------------
def other(p: LogState, line: str) -> None:
    s = line.strip()
    if "Watchdog caught collective operation timeout" in s or "WorkNCCL(" in s:
        watchdog(p, s)
        return
    if "detected by watchdog at work" in s or "Timeout at NCCL work" in s:
        m = _WD_STATE.search(s)
        if m:
            pg, guid, rank, work, enq, done = m.groups()
            key = (pg or "?", int(rank))
            if key in p.wd_state or len(p.wd_state) < MAX_RANKS:
                p.wd_state[key] = {"pg": pg, "rank": int(rank), "work": int(work),
                                      "last_enqueued": int(enq), "last_completed": int(done)}
            p.signal("watchdog_state", s)
        return
    if "joined but didn't finish" in s or "but didn't join collective" in s or "lagging ranks" in s:
        desync_report(p, s)
        return
    if "Not all ranks joining collective" in s or "missing ranks:" in s:
        fr_analysis(p, s)
        return
    if ": opCount " in s:
        p.nccl_lines += 1
        coll(p, s, s)
        return
    if "CCL version" in s and not _ERROR_WORDS.search(s):
        m = _VERSION.search(s)
        if m:
            p.nccl_lines += 1
            p.note_version(m.group(1), m.group(2), s)
        return
    if s.startswith(("HIP version", "ROCm version", "Librccl path")):
        k, _, v = s.partition(":")
        p.rccl[k.strip().lower().replace(" ", "_")] = v.strip()
        return
    if _ERROR_WORDS.search(s):
        p.nccl_lines += 1
        # PyTorch's "NCCL error in: ..., unhandled cuda error, NCCL version 2.x" names its version too.
        m = _VERSION.search(s)
        if m:
            p.note_version(m.group(1), m.group(2), s)
        p.signal("nccl_error", s)
        if "unhandled cuda error" in s.lower() or "ncclUnhandledCudaError" in s:
            p.signal("unhandled_cuda_error", s)
        if "Test NCCL failure" in s or "NCCL failure" in s:
            p.signal("test_failure", s)
        return
    if s.startswith("nccl_") and "{" in s:
        prometheus(p, s)
        return
    if '"' in s:
        if s.startswith("{") and '"coll_perf"' in s:
            inspector_json(p, s)
            return
        m = _JSON_KV.match(s)
        if m:
            json_kv(p, m.group(1), json_value(m.group(2)), s)
        return
    if "collective state:" in s or s.startswith(("collective:", "expected ranks:", "group info:")):
        fr_analysis(p, s)


def watchdog(p: LogState, s: str) -> None:
    m = _WATCHDOG.search(s)
    if m:  # the usual layout, one regex
        rank, seq, op, numel_in, numel_out, timeout, ran = m.groups()
        fields = None
    else:  # other field orders / extra fields
        i = s.find("WorkNCCL(")
        if i < 0:
            return
        fields = dict(_WORK_KV.findall(s[i + 9:i + 400]))
        rank_m, ran_m = _RANK_TAG.search(s), _RAN_FOR.search(s)
        rank = rank_m.group(1) if rank_m else None
        ran = ran_m.group(1) if ran_m else None
        seq, op = fields.get("SeqNum", "-1"), fields.get("OpType", "?")
        numel_in, numel_out, timeout = fields.get("NumelIn"), fields.get("NumelOut"), fields.get("Timeout(ms)")
    try:
        key = (op, int(seq), int(timeout) if timeout else None)
    except ValueError:
        return
    t = p.timeouts.get(key)
    if t is None:
        if len(p.timeouts) >= 1000:
            return
        t = p.timeouts[key] = {"op": op, "seq": key[1], "timeout_ms": key[2], "ran_ms": None,
                                  "numel_in": None, "numel_out": None, "ranks": set(), "count": 0}
    t["count"] += 1
    if rank is not None and len(t["ranks"]) < MAX_SET:
        t["ranks"].add(int(rank))
    if ran is not None:
        t["ran_ms"] = max(t["ran_ms"] or 0, int(ran))
    if numel_in is not None and numel_in.lstrip("-").isdigit():
        t["numel_in"] = int(numel_in)
    if numel_out is not None and numel_out.lstrip("-").isdigit():
        t["numel_out"] = int(numel_out)
    p.signal("collective_timeout", s)


def desync_report(p: LogState, s: str) -> None:
    rep: dict[str, Any] | None = None
    m = _DESYNC_JOINED.search(s)
    if m:
        rep = {"kind": "joined_not_finished", "ranks": _ranks_list(m.group(1)), "seq": int(m.group(2))}
    m = m or _DESYNC_FINISHED.search(s)
    if rep is None and m:
        rep = {"kind": "finished_not_joined", "ranks": _ranks_list(m.group(1)), "seq": int(m.group(3))}
    if rep is None:
        m = _DESYNC_LAGGING.search(s)
        if m:
            rep = {"kind": "never_joined", "ranks": _ranks_list(m.group(1)), "seq": None}
    if rep is not None and len(p.desync_reports) < 100:
        rep["ranks"] = rep["ranks"][:1000]
        p.desync_reports.append(rep)
    p.signal("desync_report", s)


def fr_analysis(p: LogState, s: str) -> None:
    m = _FR_NOT_ALL.search(s)
    if m:
        if len(p.fr["analysis"]) < 100:
            p.fr["analysis"].append({"collective_seq": int(m.group(1)), "entry": int(m.group(2)),
                                        "missing_ranks": [], "collective": None, "state": None})
        p.signal("fr_mismatch", s)
        return
    if not p.fr["analysis"]:
        return
    cur = p.fr["analysis"][-1]
    m = _FR_MISSING.search(s)
    if m:
        cur["missing_ranks"] = _ranks_list(m.group(1))[:1000]
        p.signal("fr_mismatch", s)
    elif s.startswith("collective:"):
        cur["collective"] = s.split(":", 1)[1].strip()
    elif s.startswith("collective state:"):
        cur["state"] = s.split(":", 1)[1].strip()
    elif s.startswith("expected ranks:"):
        try:
            cur["expected_ranks"] = int(s.split(":", 1)[1])
        except ValueError:
            pass
    elif s.startswith("group info:"):
        cur["group"] = s.split(":", 1)[1].strip()


def json_kv(p: LogState, key: str, raw: str, s: str) -> None:
    if key in _FR_KEYS:
        fr_kv(p, key, raw, s)
    if key in _INSPECTOR_KEYS:
        insp_kv(p, key, raw, s)


def scalar(raw: str):
    raw = raw.strip().rstrip(",")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than json follows
        return raw.strip('"')


def fr_kv(p: LogState, key: str, raw: str, s: str) -> None:
    v = scalar(raw)
    fr = p.fr
    fr["seen"] = True
    if key == "profiling_name":
        fr["entries"] += 1
        fr["ops"][v] = fr["ops"].get(v, 0) + 1 if len(fr["ops"]) < 256 or v in fr["ops"] else 0
        p.fr_cur = {"op": v}
    elif key == "state" and p.fr_cur is not None:
        fr["states"][str(v)] = fr["states"].get(str(v), 0) + 1
        if v not in ("completed",):
            p.signal("fr_incomplete", s)
    elif key == "collective_seq_id" and p.fr_cur is not None:
        p.fr_cur["seq"] = v
        if isinstance(v, int):
            fr["max_seq"] = max(fr.get("max_seq", -1), v)
    elif key == "timeout_ms":
        fr["timeout_ms"] = v
    elif key.startswith("last_"):
        fr["pg_status"][key] = v
    p.signal("flight_recorder", s)


def insp_kv(p: LogState, key: str, raw: str, s: str) -> None:
    v = scalar(raw)
    cur = p.insp_cur
    if key == "n_ranks":
        p.inspector["n_ranks"] = v
    elif key == "nnodes":
        p.inspector["nnodes"] = v
    elif key == "hostname" and isinstance(v, str) and len(p.hosts) < MAX_SET:
        p.hosts.add(v)
    elif key == "inspector_output_format_version":
        p.inspector["format"] = v
    else:
        cur[key] = v
        if key == "coll_busbw_gbs":
            insp_record(p, dict(cur), s)
            cur.clear()


def inspector_json(p: LogState, s: str) -> None:
    try:
        obj = json.loads(s)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than json follows
        return
    hdr = obj.get("header", {}) if isinstance(obj, dict) else {}
    meta = obj.get("metadata", {}) if isinstance(obj, dict) else {}
    if hdr.get("n_ranks") is not None:
        p.inspector["n_ranks"] = hdr["n_ranks"]
    if meta.get("hostname") and len(p.hosts) < MAX_SET:
        p.hosts.add(meta["hostname"])
    perf = obj.get("coll_perf") if isinstance(obj, dict) else None
    if isinstance(perf, dict):
        insp_record(p, perf, s)


def insp_record(p: LogState, rec: dict, s: str) -> None:
    coll = str(rec.get("coll", "?"))
    a: dict[str, Any] | None = p.inspector["colls"].get(coll)
    if a is None:
        if len(p.inspector["colls"]) >= 64:
            return
        a = {"coll": coll, "count": 0, "busbw_sum": 0.0, "busbw_max": None, "max_msg_size_bytes": 0,
             "exec_time_us_sum": 0.0}
        p.inspector["colls"][coll] = a
    p.inspector["records"] += 1
    a["count"] += 1
    bw = rec.get("coll_busbw_gbs")
    if isinstance(bw, int | float):
        a["busbw_sum"] += bw
        a["busbw_max"] = bw if a["busbw_max"] is None else max(a["busbw_max"], bw)
    size = rec.get("coll_msg_size_bytes") or rec.get("message_size")
    if isinstance(size, int):
        a["max_msg_size_bytes"] = max(a["max_msg_size_bytes"], size)
    t = rec.get("coll_exec_time_us")
    if isinstance(t, int | float):
        a["exec_time_us_sum"] += t
    p.signal("inspector", s)


def prometheus(p: LogState, s: str) -> None:
    m = _PROM.match(s)
    if not m:
        return
    name, labels, value = m.groups()
    lab = dict(_PROM_LABEL.findall(labels))
    try:
        v = float(value)
    except ValueError:
        return
    if lab.get("node") and len(p.hosts) < MAX_SET:
        p.hosts.add(lab["node"])
    if name == "nccl_bus_bandwidth_gbs":
        insp_record(p, {"coll": lab.get("collective", "?"), "coll_busbw_gbs": v}, s)
        if lab.get("nranks", "").isdigit():
            p.inspector["n_ranks"] = p.inspector["n_ranks"] or int(lab["nranks"])
    else:
        p.signal("inspector", s)
