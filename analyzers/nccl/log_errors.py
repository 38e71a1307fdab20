"""The failure side of the NCCL log parser: WARN lines and their `file.cc:line -> code`
error chains, and the lines that are not NCCL's own: PyTorch watchdog timeouts and desync
reports, flight-recorder dumps, NCCL Inspector JSON and its Prometheus output.
"""

from __future__ import annotations

import json
import re

from diag.analyzers.nccl.ib_status import ib_status_by_name, nccl_result
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

# What an application or nccl-tests prints when NCCL returned an error.
_ERROR_WORDS = re.compile(r"NCCL error|DistBackendError|nccl(?:System|Remote|Internal|UnhandledCuda)Error|"
                          r"NCCL failure")
# A CUDA allocation NCCL made that failed for want of device memory ("Cuda failure 'out of
# memory'", "Cuda failure 2 'out of memory'", "Failed to CUDA calloc 6291456 bytes", cuMem* calls
# returning CUDA_ERROR_OUT_OF_MEMORY).
_OUT_OF_MEMORY = re.compile(r"out of memory|OUT_OF_MEMORY|Failed to CUDA (?:c|m)alloc|hipErrorOutOfMemory", re.I)


class ErrorLines:
    """WARN lines, error chains and PyTorch / flight-recorder / Inspector lines. A part of NcclLogParser (log.py)."""

    def _chain(self, line: str, pfx: tuple, m: re.Match) -> None:
        file, lineno, code, rest = m.groups()
        tkey = (pfx[0], pfx[1], pfx[2], pfx[3])
        frames = self._open_chain.get(tkey)
        if frames is None:
            if len(self._open_chain) >= MAX_CACHE:
                self._open_chain.clear()
                self._chain_warn.clear()
            frames = self._open_chain[tkey] = []
            warn = self._last_warn.pop(tkey, None)
            if warn is not None:
                self._chain_warn[tkey] = warn
        if len(frames) < 64:
            frames.append((f"{file}:{lineno}", int(code), "[Async thread]" in rest or "[Proxy Thread]" in rest))
        b = self.signal("error_chain", line)
        b.data["last_code"] = int(code)
        if file.endswith(("init.cc", "bootstrap.cc")) or file.startswith("init"):
            self.signal("init_failure", line)

    def _close_chains(self) -> None:
        for tkey, frames in self._open_chain.items():
            self._record_chain(frames, self._chain_warn.get(tkey))
        self._open_chain.clear()
        self._chain_warn.clear()

    def _end_chain(self, tkey: tuple) -> None:
        frames = self._open_chain.pop(tkey, None)
        if frames is not None:
            self._record_chain(frames, self._chain_warn.pop(tkey, None))

    def _record_chain(self, frames: list, warn: str | None) -> None:
        """One finished `file.cc:line -> code` chain (innermost frame first), counted by its frames,
        with the WARN line on the same thread that it followed (None: no WARN started it here)."""
        if not frames:
            return
        key = tuple(f for f, _, _ in frames)
        c = self.chains.get(key)
        if c is None:
            if len(self.chains) >= MAX_CHAINS:
                return
            code = frames[0][1]
            c = self.chains[key] = {"code": code, "code_name": nccl_result(code)["name"], "frames": list(key),
                                    "origin": key[0], "async": any(a for _, _, a in frames), "count": 0,
                                    "started_by": warn}
        elif c["started_by"] is None:
            c["started_by"] = warn
        c["count"] += 1

    # -- NCCL WARN -------------------------------------------------------------------------
    def _warn(self, line: str, pre: str, msg: str) -> None:
        self.warn_total += 1
        pfx = self._prefix(pre)
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
        w = self.warn_kinds.get(kind)
        if w is None:
            if len(self.warn_kinds) >= MAX_WARN_KINDS:
                kind = "other"
                w = self.warn_kinds.get(kind)
            if w is None:
                w = self.warn_kinds[kind] = {"kind": kind, "location": short, "message": msg[:300], "count": 0,
                                             "hosts": [], "evidence": []}
        w["count"] += 1
        if pfx[0] and pfx[0] not in w["hosts"] and len(w["hosts"]) < 64:
            w["hosts"].append(pfx[0])
        if len(w["evidence"]) < self.cap:
            w["evidence"].append(line[:1000])
        # a WARN ends the thread's open error chain and may start the next one
        tkey = (pfx[0], pfx[1], pfx[2], pfx[3])
        self._end_chain(tkey)
        if len(self._last_warn) >= MAX_CACHE:
            self._last_warn.clear()
        self._last_warn[tkey] = line[:1000]
        self._classify_warn(line, msg, short)

    def _classify_warn(self, line: str, msg: str, loc: str | None) -> None:
        if "Got completion" in msg:
            m = _IB_COMPLETION.search(msg)
            if m:
                peer, sname, code, opcode, vendor = m.groups()
                code = int(code)
                if sname and ib_status_by_name(sname) is not None:
                    code = ib_status_by_name(sname)
                self.signal("ib_completion_error", line, statuses=[code], peers=[peer] if peer else None,
                            vendor=[int(vendor)] if vendor else None)
                return
        if (loc or "").rsplit("/", 1)[-1].startswith("proxy.cc") or "[Proxy Service" in msg or "[Service thread]" in msg:
            m = _PROXY_OP.search(msg)
            self.signal("proxy_failure", line, operations=[m.group(1)] if m else None,
                        ranks=[int(m.group(2))] if m else None)
            return
        if ("socket" in (loc or "")) or any(w in msg for w in _SOCKET_WORDS):
            self.signal("socket_error", line)
            if "bootstrap" in msg.lower():
                self.signal("init_failure", line)
            return
        if "libibverbs" in msg:
            self.signal("ibverbs_missing", line)
        elif "iommu" in msg:
            self.signal("rocm_iommu", line)
        elif "Failed to find CUDA library" in msg or "libcuda" in msg:
            self.signal("cuda_library_missing", line)
        elif "Could not find a path" in msg or "falling back" in msg or "graph/search.cc" in (loc or ""):
            # (the topology search's own warnings, also when a pasted log cut the line short)
            self.signal("topology_fallback", line)
        elif "async fatal event" in msg or "NET/IB" in msg:
            self.signal("ib_error", line)
        elif _OUT_OF_MEMORY.search(msg):
            self.signal("cuda_oom", line)
        elif "Cuda failure" in msg or "CUDA failure" in msg or "Hip failure" in msg:
            self.signal("cuda_failure", line)
        elif loc and (loc.endswith(("init.cc", "bootstrap.cc")) and ("fail" in msg.lower() or "error" in msg.lower())):
            self.signal("init_failure", line)
        elif "Timeout" in msg or "timeout" in msg:
            self.signal("nccl_timeout_warn", line)
        elif _WARN_FAILURE.search(msg) and not _WARN_BENIGN.search(msg):
            self.signal("warn_failure", line)  # a failure no specific rule names: still reported

    # -- lines without an NCCL INFO/WARN tag ----------------------------------------------
    def _other(self, line: str) -> None:
        s = line.strip()
        if "Watchdog caught collective operation timeout" in s or "WorkNCCL(" in s:
            self._watchdog(s)
            return
        if "detected by watchdog at work" in s or "Timeout at NCCL work" in s:
            m = _WD_STATE.search(s)
            if m:
                pg, guid, rank, work, enq, done = m.groups()
                key = (pg or "?", int(rank))
                if key in self.wd_state or len(self.wd_state) < MAX_RANKS:
                    self.wd_state[key] = {"pg": pg, "rank": int(rank), "work": int(work),
                                          "last_enqueued": int(enq), "last_completed": int(done)}
                self.signal("watchdog_state", s)
            return
        if "joined but didn't finish" in s or "but didn't join collective" in s or "lagging ranks" in s:
            self._desync_report(s)
            return
        if "Not all ranks joining collective" in s or "missing ranks:" in s:
            self._fr_analysis(s)
            return
        if ": opCount " in s:
            self.nccl_lines += 1
            self._coll(s, s)
            return
        if "CCL version" in s and not _ERROR_WORDS.search(s):
            m = _VERSION.search(s)
            if m:
                self.nccl_lines += 1
                self._version(m.group(1), m.group(2), s)
            return
        if s.startswith(("HIP version", "ROCm version", "Librccl path")):
            k, _, v = s.partition(":")
            self.rccl[k.strip().lower().replace(" ", "_")] = v.strip()
            return
        if _ERROR_WORDS.search(s):
            self.nccl_lines += 1
            # PyTorch's "NCCL error in: ..., unhandled cuda error, NCCL version 2.x" names its version too.
            m = _VERSION.search(s)
            if m:
                self._version(m.group(1), m.group(2), s)
            self.signal("nccl_error", s)
            if "unhandled cuda error" in s.lower() or "ncclUnhandledCudaError" in s:
                self.signal("unhandled_cuda_error", s)
            if "Test NCCL failure" in s or "NCCL failure" in s:
                self.signal("test_failure", s)
            return
        if s.startswith("nccl_") and "{" in s:
            self._prometheus(s)
            return
        if '"' in s:
            if s.startswith("{") and '"coll_perf"' in s:
                self._inspector_json(s)
                return
            m = _JSON_KV.match(s)
            if m:
                self._json_kv(m.group(1), json_value(m.group(2)), s)
            return
        if "collective state:" in s or s.startswith(("collective:", "expected ranks:", "group info:")):
            self._fr_analysis(s)

    def _watchdog(self, s: str) -> None:
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
        t = self.timeouts.get(key)
        if t is None:
            if len(self.timeouts) >= 1000:
                return
            t = self.timeouts[key] = {"op": op, "seq": key[1], "timeout_ms": key[2], "ran_ms": None,
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
        self.signal("collective_timeout", s)

    def _desync_report(self, s: str) -> None:
        rep = None
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
        if rep is not None and len(self.desync_reports) < 100:
            rep["ranks"] = rep["ranks"][:1000]
            self.desync_reports.append(rep)
        self.signal("desync_report", s)

    def _fr_analysis(self, s: str) -> None:
        m = _FR_NOT_ALL.search(s)
        if m:
            if len(self.fr["analysis"]) < 100:
                self.fr["analysis"].append({"collective_seq": int(m.group(1)), "entry": int(m.group(2)),
                                            "missing_ranks": [], "collective": None, "state": None})
            self.signal("fr_mismatch", s)
            return
        if not self.fr["analysis"]:
            return
        cur = self.fr["analysis"][-1]
        m = _FR_MISSING.search(s)
        if m:
            cur["missing_ranks"] = _ranks_list(m.group(1))[:1000]
            self.signal("fr_mismatch", s)
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

    def _json_kv(self, key: str, raw: str, s: str) -> None:
        if key in _FR_KEYS:
            self._fr_kv(key, raw, s)
        if key in _INSPECTOR_KEYS:
            self._insp_kv(key, raw, s)

    @staticmethod
    def _scalar(raw: str):
        raw = raw.strip().rstrip(",")
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than json follows
            return raw.strip('"')

    def _fr_kv(self, key: str, raw: str, s: str) -> None:
        v = self._scalar(raw)
        fr = self.fr
        fr["seen"] = True
        if key == "profiling_name":
            fr["entries"] += 1
            fr["ops"][v] = fr["ops"].get(v, 0) + 1 if len(fr["ops"]) < 256 or v in fr["ops"] else 0
            self._fr_cur = {"op": v}
        elif key == "state" and self._fr_cur is not None:
            fr["states"][str(v)] = fr["states"].get(str(v), 0) + 1
            if v not in ("completed",):
                self.signal("fr_incomplete", s)
        elif key == "collective_seq_id" and self._fr_cur is not None:
            self._fr_cur["seq"] = v
            if isinstance(v, int):
                fr["max_seq"] = max(fr.get("max_seq", -1), v)
        elif key == "timeout_ms":
            fr["timeout_ms"] = v
        elif key.startswith("last_"):
            fr["pg_status"][key] = v
        self.signal("flight_recorder", s)

    def _insp_kv(self, key: str, raw: str, s: str) -> None:
        v = self._scalar(raw)
        cur = self._insp_cur
        if key == "n_ranks":
            self.inspector["n_ranks"] = v
        elif key == "nnodes":
            self.inspector["nnodes"] = v
        elif key == "hostname" and isinstance(v, str) and len(self.hosts) < MAX_SET:
            self.hosts.add(v)
        elif key == "inspector_output_format_version":
            self.inspector["format"] = v
        else:
            cur[key] = v
            if key == "coll_busbw_gbs":
                self._insp_record(dict(cur), s)
                cur.clear()

    def _inspector_json(self, s: str) -> None:
        try:
            obj = json.loads(s)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than json follows
            return
        hdr = obj.get("header", {}) if isinstance(obj, dict) else {}
        meta = obj.get("metadata", {}) if isinstance(obj, dict) else {}
        if hdr.get("n_ranks") is not None:
            self.inspector["n_ranks"] = hdr["n_ranks"]
        if meta.get("hostname") and len(self.hosts) < MAX_SET:
            self.hosts.add(meta["hostname"])
        perf = obj.get("coll_perf") if isinstance(obj, dict) else None
        if isinstance(perf, dict):
            self._insp_record(perf, s)

    def _insp_record(self, rec: dict, s: str) -> None:
        coll = str(rec.get("coll", "?"))
        a = self.inspector["colls"].get(coll)
        if a is None:
            if len(self.inspector["colls"]) >= 64:
                return
            a = self.inspector["colls"][coll] = {"coll": coll, "count": 0, "busbw_sum": 0.0, "busbw_max": None,
                                                 "max_msg_size_bytes": 0, "exec_time_us_sum": 0.0}
        self.inspector["records"] += 1
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
        self.signal("inspector", s)

    def _prometheus(self, s: str) -> None:
        m = _PROM.match(s)
        if not m:
            return
        name, labels, value = m.groups()
        lab = dict(_PROM_LABEL.findall(labels))
        try:
            v = float(value)
        except ValueError:
            return
        if lab.get("node") and len(self.hosts) < MAX_SET:
            self.hosts.add(lab["node"])
        if name == "nccl_bus_bandwidth_gbs":
            self._insp_record({"coll": lab.get("collective", "?"), "coll_busbw_gbs": v}, s)
            if lab.get("nranks", "").isdigit():
                self.inspector["n_ranks"] = self.inspector["n_ranks"] or int(lab["nranks"])
        else:
            self.signal("inspector", s)
