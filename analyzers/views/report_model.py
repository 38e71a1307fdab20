"""The bottleneck report's data model: what the HTML, Markdown and JSON reports show.

`build_model(doc, run)` is pure: it takes an analysis document (schema diag.analysis/1)
and the raw contents of a run directory already read into memory (`run`, see
`RUN_KEYS`), and returns plain data. Nothing here reads files, prints or plots.

The model answers four questions for a reader who has not seen the code:
  what bounds the training      -> "headline" (verdict sentence with its numbers)
  how sure we are, and why      -> "confidence", "evidence", "decision_path"
  what to change first          -> "recommendations", ranked by expected gain
  what it should buy            -> each recommendation's "gain" (share of step time)
and says what data was missing and how to collect it ("missing").

Expected gain. Every moment of a step is attributed to exactly one of five phases, so
removing a phase entirely shortens the step by that phase's share s, a speed-up of
1 / (1 - s). That is the upper bound we quote ("up to"). Fixes rarely remove a phase
entirely; the ranking uses the same upper bound for every phase so that the order is
the order of the measured shares, which is what the measurements support.

Big runs are aggregated so the report stays small and fast: per-step series are
bucketed to at most `Limits.series_points` points, heatmaps to `Limits.heatmap_columns`
columns, metric timelines of many ranks become min/median/max bands; each such
reduction is written into "notes" so the page says so.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass

import numpy as np

from diag.analyzers.diagnosis import decision_tree

MODEL_SCHEMA = "diag.report/1"
PHASES = ("data", "host", "comm", "memory", "compute")
PHASE_LABELS = {
    "data": "waiting for data",
    "host": "host overhead (device idle)",
    "comm": "exposed communication",
    "memory": "bandwidth-bound kernels",
    "compute": "compute kernels",
}
# What the share of each phase means in one phrase, used in the headline sentence.
PHASE_PHRASES = {
    "data": "waiting for the DataLoader takes",
    "host": "the device sits idle while the host launches, synchronises or runs Python for",
    "comm": "exposed communication (not hidden behind computation) is",
    "memory": "bandwidth-bound kernels (elementwise, norms, copies) take",
    "compute": "compute kernels (matmul, convolution, attention) take",
}
# Keys of the `run` argument; all optional.
RUN_KEYS = {
    "path": "run directory path (str)",
    "manifest": "manifest.json contents",
    "ranks": "{rank: {'info': rank.json, 'steps': [...], 'samples': [...], 'events': [...], "
    "'windows': [...], 'traces': int, 'nccl_logs': int}}",
    "missing_ranks": "ranks expected from the world size but absent",
    "problems": "unreadable or damaged files, one line each",
    "nccl_log": "diag.nccl_log/1 document or None",
    "nccl_log_summary": "diag.analyzers.nccl.log.summarize_for_diagnosis(doc): sentences, most severe first",
    "nccl_bench": "diag.nccl_bench/1 document or None",
    "nccl_interpretation": "[{'collective', **diag.analyzers.nccl.expected.interpret(test, topology)}]",
    "unavailable": "{feature: reason} for analyzer modules that could not be used",
}
# Clock-event reasons that are not throttling: the GPU is idle or clocks were set on purpose.
BENIGN_CLOCK_EVENTS = {"gpu_idle", "applications_clocks_setting", "none", "display_clock_setting"}


@dataclass(frozen=True)
class Limits:
    series_points: int = 500  # points per step-indexed chart
    heatmap_columns: int = 200  # step (or collective) buckets per heatmap row
    timeline_points: int = 600  # points per metric timeline
    rank_lines: int = 8  # above this many ranks, timelines become min/median/max bands
    table_rows: int = 20  # kernels and ops
    rank_rows: int = 256  # per-rank table rows


def build_model(doc: dict | None, run: dict | None = None, tree=None, limits: Limits | None = None) -> dict:
    """The report model from an analysis document and a run directory's records."""
    doc = doc if isinstance(doc, dict) else {}
    run = run or {}
    limits = limits or Limits()
    tree = tree or decision_tree.load_tree()
    notes: list[str] = []

    ranks = _merge_ranks(doc, run)
    # The run analysis also counts ranks that stopped reporting; those have data up to then.
    job_missing = {r for r in (doc.get("job") or {}).get("missing_ranks") or [] if isinstance(r, int)}
    run = {**run, "missing_ranks": sorted((set(run.get("missing_ranks") or []) | job_missing) - set(ranks)),
           "stopped_ranks": sorted(job_missing & set(ranks))}
    world = _world_size(doc, run, ranks)
    allt = _concat(ranks)
    steps = _job_steps(ranks)
    job_shares = _analysed_shares(ranks) or _tw_shares(allt)
    bound, bound_source = _job_bound(doc, ranks, allt, job_shares, tree)
    path = _decision_path(doc, ranks, bound, job_shares, tree)
    stragglers = _stragglers(doc)
    nccl = _nccl_section(run)
    evidence = _evidence(doc, ranks, allt, steps, job_shares, stragglers, nccl)
    rank_rows = _rank_rows(ranks, stragglers, limits, notes)
    headline = _headline(bound, ranks, allt, world, job_shares, tree, nccl, stragglers, doc)
    confidence = _confidence(bound, allt, path, run, world)
    memory = _memory_section(ranks, tree)
    recs = _recommendations(bound, job_shares, tree, doc, ranks, stragglers, nccl, memory, evidence)
    headline["note"] = _order_note(bound, recs, job_shares)
    charts = {
        "phases": _phase_series(steps, limits, notes),
        "throughput": _throughput_series(ranks, steps, limits, notes),
        "heatmap_step": _step_heatmap(ranks, limits, notes),
        "heatmap_wait": _wait_heatmap(doc, ranks, limits, notes),
        "timelines": _timelines(ranks, limits, notes),
        "nccl_busbw": nccl.get("busbw_chart"),
    }
    model = {
        "schema": MODEL_SCHEMA,
        "run": _run_meta(doc, run, ranks, world, steps),
        "bound": bound,
        "headline": headline,
        "confidence": confidence,
        "decision_path": path,
        "phase_shares": {p: job_shares.get(p) for p in PHASES} if job_shares else None,
        "evidence": evidence,
        "recommendations": recs,
        "stragglers": stragglers,
        "ranks": rank_rows,
        "step_stats": _step_stats(steps),
        "step_times_s": [round(float(x), 6) for x in steps.dur[~np.isnan(steps.dur)]],
        "throughput": _throughput_summary(ranks, steps),
        "top_kernels": _top_table(doc, "top_kernels", limits),
        "top_ops": _top_table(doc, "top_ops", limits),
        "findings": _findings(doc, ranks),
        "memory": memory,
        "nccl": {k: v for k, v in nccl.items() if k != "busbw_chart"},
        "charts": charts,
        "missing": _missing(run, ranks, allt, world, nccl),
        "problems": _problems(doc, run),
        "notes": notes,
    }
    return model


# ---------------------------------------------------------------------------- inputs


def _num(v) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return None if math.isnan(v) or math.isinf(v) else float(v)


BOUND_CODE = {p: i for i, p in enumerate(PHASES)}
EVIDENCE_CODE = {"sampled": 1, "trace": 2}
_NAN = float("nan")


def _f(v) -> float:
    """A number from JSON as float, NaN when absent or not a number (bools are not numbers)."""
    t = type(v)
    return float(v) if t is float or t is int else _NAN


def _share_row(sh):
    if type(sh) is not dict:
        return None
    try:
        return (float(sh["data"]), float(sh["host"]), float(sh["comm"]), float(sh["memory"]), float(sh["compute"]))
    except (KeyError, TypeError, ValueError):
        return None


class Steps:
    """One rank's (or the job's) steps as columns: numpy arrays, NaN where not measured.

    Columnar because big runs have 10^5-10^6 step records and every chart and figure is a
    reduction over them.
    """

    FIELDS = ("dur", "start", "wait", "samples", "tokens", "peak", "mfu")

    def __init__(self, n: int):
        self.step = np.zeros(n, dtype=np.int64)
        for f in self.FIELDS:
            setattr(self, f, np.full(n, np.nan))
        self.shares = np.full((n, 5), np.nan)
        self.bound = np.full(n, -1, dtype=np.int8)
        self.ev = np.zeros(n, dtype=np.int8)

    def __len__(self) -> int:
        return len(self.step)

    @property
    def has_shares(self) -> np.ndarray:
        return ~np.isnan(self.shares[:, 0])


def _rank_steps(records: list, doc_steps: list) -> Steps:
    """Step records (contract C) merged with analysed steps (contract A); the analysis wins
    for shares, verdict and evidence, the records for timings."""
    rows: dict[int, list] = {}
    for rec in records:
        if type(rec) is not dict:
            continue
        st = rec.get("step")
        if type(st) is not int:
            continue
        rows[st] = [_f(rec.get("duration_s")), _f(rec.get("start_unix")), _f(rec.get("data_wait_s")),
                    _f(rec.get("samples")), _f(rec.get("tokens")), _f(rec.get("peak_mem_bytes")),
                    _f(rec.get("mfu")), _share_row(rec.get("shares")), BOUND_CODE.get(rec.get("bound"), -1),
                    EVIDENCE_CODE.get(rec.get("evidence"), 0)]
    for st in doc_steps:
        if type(st) is not dict or type(st.get("step")) is not int:
            continue
        row = rows.get(st["step"])
        if row is None:
            row = rows[st["step"]] = [_NAN] * 7 + [None, -1, 0]
        sh = _share_row(st.get("shares"))
        if sh is not None:
            row[7] = sh
        b = BOUND_CODE.get(st.get("bound"), -1)
        if b >= 0:
            row[8] = b
        e = EVIDENCE_CODE.get(st.get("evidence"), 0)
        if e:
            row[9] = e
        if math.isnan(row[0]):
            row[0] = _f(st.get("duration_ms")) / 1000.0
        if math.isnan(row[2]):
            row[2] = _f(st.get("data_wait_ms")) / 1000.0
        for i, k in ((3, "samples"), (4, "tokens"), (5, "peak_mem_bytes"), (6, "mfu")):
            if math.isnan(row[i]):
                row[i] = _f(st.get(k))
    order = sorted(rows)
    t = Steps(len(order))
    if not order:
        return t
    t.step[:] = order
    table = [rows[k] for k in order]
    for i, f in enumerate(Steps.FIELDS):
        col = np.fromiter((r[i] for r in table), dtype=np.float64, count=len(table))
        col[~np.isfinite(col)] = np.nan
        setattr(t, f, col)
    t.dur[t.dur <= 0] = np.nan
    have = [i for i, r in enumerate(table) if r[7] is not None]
    if have:
        sh = np.array([table[i][7] for i in have], dtype=np.float64)
        total = sh.sum(axis=1)
        ok = np.isfinite(total) & (total > 0) & (sh >= 0).all(axis=1)
        sh[ok] /= total[ok, None]
        sh[~ok] = np.nan
        t.shares[have] = sh
    t.bound[:] = [r[8] for r in table]
    t.ev[:] = [r[9] for r in table]
    # Steps with shares but no verdict: the largest share stands in.
    fill = (t.bound < 0) & t.has_shares
    if fill.any():
        t.bound[fill] = np.argmax(t.shares[fill], axis=1)
    return t


def _covers_records(analysis: dict) -> bool:
    """True when the rank dict came from the run analysis, whose steps hold the records' timings."""
    ev = analysis.get("evidence")
    return isinstance(ev, dict) and "sampled_steps" in ev and bool(analysis.get("steps"))


def _merge_ranks(doc: dict, run: dict) -> dict[int, dict]:
    """Per rank: its analysis dict, facts, and step records merged with analysed steps."""
    out: dict[int, dict] = {}
    run_ranks = run.get("ranks") or {}
    doc_ranks = {}
    for r in doc.get("ranks") or []:
        if isinstance(r, dict) and isinstance(r.get("rank"), int):
            doc_ranks.setdefault(r["rank"], r)
    for rank in sorted(set(doc_ranks) | {int(k) for k in run_ranks}):
        analysis = doc_ranks.get(rank, {})
        raw = run_ranks.get(rank) or run_ranks.get(str(rank)) or {}
        info = raw.get("info") or {}
        out[rank] = {
            "rank": rank,
            "analysis": analysis,
            "info": info,
            "host": _first_str(info, "hostname", "host") or _first_str(analysis, "host", "hostname"),
            "device": _device_name(info, analysis),
            # The run analysis already carries every step record's timings in its steps; the raw
            # records are only read for ranks it does not cover (halves the work on big runs).
            "t": _rank_steps([] if _covers_records(analysis) else raw.get("steps") or [],
                             analysis.get("steps") or []),
            "samples": [s for s in raw.get("samples") or [] if isinstance(s, dict)],
            "windows": [w for w in raw.get("windows") or [] if isinstance(w, dict)],
            "traces": raw.get("traces") or 0,
            "nccl_logs": raw.get("nccl_logs") or 0,
            "events": [e for e in raw.get("events") or [] if isinstance(e, dict)],
        }
    return out


def _first_str(d, *keys) -> str | None:
    if not isinstance(d, dict):
        return None
    for k in keys:
        v = d.get(k)
        if isinstance(v, str) and v:
            return v
    return None


def _device_name(info: dict, analysis: dict) -> str | None:
    for src in (analysis.get("device"), info.get("device")):
        if isinstance(src, str) and src:
            return src
        if isinstance(src, dict):
            name = _first_str(src, "name", "type")
            if name:
                return name
    return None


def _world_size(doc: dict, run: dict, ranks: dict) -> int:
    cands = [(doc.get("job") or {}).get("world_size"), (run.get("manifest") or {}).get("world_size")]
    cands += [r["analysis"].get("world_size") for r in ranks.values()]
    cands += [r["info"].get("world_size") for r in ranks.values()]
    cands = [c for c in cands if isinstance(c, int) and c > 0]
    present = len(ranks) + len(run.get("missing_ranks") or [])
    return max(cands + [present, 1])


def _tw_shares(t: Steps) -> dict | None:
    """Shares over many steps, each step weighted by its duration (1 where unknown)."""
    ok = t.has_shares
    if not ok.any():
        return None
    w = np.where(np.isnan(t.dur[ok]), 1.0, t.dur[ok])
    v = (t.shares[ok] * w[:, None]).sum(axis=0) / w.sum()
    return {p: float(v[i]) for i, p in enumerate(PHASES)}


def _rank_shares(r: dict) -> dict | None:
    """The rank's shares as its analysis gives them (the run analysis leaves warm-up steps out,
    so these match the decision path), else time-weighted over its steps."""
    sh = _share_row(r["analysis"].get("shares"))
    if sh is not None and all(math.isfinite(x) and x >= 0 for x in sh) and sum(sh) > 0:
        return {p: sh[i] / sum(sh) for i, p in enumerate(PHASES)}
    return _tw_shares(r["t"])


def _analysed_shares(ranks: dict) -> dict | None:
    """The job's shares: the mean over ranks of each rank's shares (None if a rank has none)."""
    per = [_rank_shares(r) for r in ranks.values()]
    if not per or any(x is None for x in per):
        return None
    return {p: sum(x[p] for x in per) / len(per) for p in PHASES}


def _concat(ranks: dict) -> Steps:
    """All ranks' steps in one table (for counts and distributions)."""
    parts = [r["t"] for r in ranks.values()]
    t = Steps(0)
    if not parts:
        return t
    t.step = np.concatenate([p.step for p in parts])
    for f in Steps.FIELDS:
        setattr(t, f, np.concatenate([getattr(p, f) for p in parts]))
    t.shares = np.concatenate([p.shares for p in parts])
    t.bound = np.concatenate([p.bound for p in parts])
    t.ev = np.concatenate([p.ev for p in parts])
    return t


def _job_steps(ranks: dict) -> Steps:
    """One row per step number across ranks: the job's step time is the slowest rank's,
    shares are the mean over ranks, the verdict the most common one."""
    allt = _concat(ranks)
    steps = np.unique(allt.step)
    job = Steps(len(steps))
    if not len(steps):
        return job
    job.step = steps
    pos = np.searchsorted(steps, allt.step)
    with np.errstate(invalid="ignore"):
        np.fmax.at(job.dur, pos, allt.dur)
        np.fmin.at(job.start, pos, allt.start)
        for f in ("samples", "tokens"):
            col = getattr(allt, f)
            m = ~np.isnan(col)
            acc = np.zeros(len(steps))
            np.add.at(acc, pos[m], col[m])
            seen = np.zeros(len(steps), dtype=bool)
            seen[pos[m]] = True
            setattr(job, f, np.where(seen, acc, np.nan))
        for f in ("mfu", "wait"):
            col = getattr(allt, f)
            m = ~np.isnan(col)
            acc, cnt = np.zeros(len(steps)), np.zeros(len(steps))
            np.add.at(acc, pos[m], col[m])
            np.add.at(cnt, pos[m], 1)
            setattr(job, f, np.where(cnt > 0, acc / np.maximum(cnt, 1), np.nan))
        m = allt.has_shares
        acc, cnt = np.zeros((len(steps), 5)), np.zeros(len(steps))
        np.add.at(acc, pos[m], allt.shares[m])
        np.add.at(cnt, pos[m], 1)
        job.shares = np.where(cnt[:, None] > 0, acc / np.maximum(cnt, 1)[:, None], np.nan)
        m = allt.bound >= 0
        votes = np.zeros((len(steps), 5))
        np.add.at(votes, (pos[m], allt.bound[m]), 1)
        job.bound = np.where(votes.sum(axis=1) > 0, np.argmax(votes, axis=1), -1).astype(np.int8)
        np.maximum.at(job.ev, pos, allt.ev)
    return job


def _mean(values) -> float | None:
    v = [x for x in values if x is not None]
    return float(sum(v) / len(v)) if v else None


def _measurements(shares: dict) -> dict:
    m = {f"{p}_share": shares[p] for p in PHASES}
    if shares["compute"] > 0:
        m["memory_to_compute"] = shares["memory"] / shares["compute"]
    elif shares["memory"] > 0:
        m["memory_to_compute"] = math.inf
    return m


def _job_bound(doc: dict, ranks: dict, allt: Steps, job_shares: dict | None, tree) -> tuple[str | None, str]:
    b = (doc.get("job") or {}).get("bound")
    if b in PHASES:
        return b, "analysis"
    votes = Counter(r["analysis"].get("bound") for r in ranks.values() if r["analysis"].get("bound") in PHASES)
    if votes:
        return votes.most_common(1)[0][0], "ranks"
    if job_shares:
        return decision_tree.evaluate(_measurements(job_shares), tree)["bound"], "shares"
    b = _mode_bound(allt.bound)
    return (b, "steps") if b else (None, "none")


def _mode_bound(codes: np.ndarray) -> str | None:
    codes = codes[codes >= 0]
    if not len(codes):
        return None
    return PHASES[int(np.argmax(np.bincount(codes, minlength=5)))]


def _decision_path(doc, ranks, bound, job_shares, tree) -> dict | None:
    """The path that led to the verdict: the analysed one of a rank with the job's verdict,
    else the tree walked on the job's time-weighted shares."""
    jp = (doc.get("job") or {}).get("path")
    if isinstance(jp, list) and jp and (doc.get("job") or {}).get("bound") == bound:
        return {"source": "the whole job (time-weighted over steps and ranks)", "nodes": _clean_path(jp),
                "bound": bound}
    for r in sorted(ranks.values(), key=lambda r: r["rank"]):
        p = r["analysis"].get("path")
        if r["analysis"].get("bound") == bound and isinstance(p, list) and p:
            return {"source": f"rank {r['rank']}'s measurements over its steps", "nodes": _clean_path(p),
                    "bound": bound}
    if job_shares:
        ev = decision_tree.evaluate(_measurements(job_shares), tree)
        return {
            "source": "the job's time-weighted phase shares over all steps and ranks",
            "nodes": _clean_path(ev["path"]),
            "bound": ev["bound"],
        }
    return None


def _clean_path(path: list) -> list[dict]:
    out = []
    for n in path:
        if not isinstance(n, dict):
            continue
        out.append(
            {
                "question": str(n.get("question", n.get("node", ""))),
                "metric": str(n.get("metric", "")),
                "value": _num(n.get("value")),
                "op": str(n.get("op", "")),
                "threshold": _num(n.get("threshold")),
                "answer": str(n.get("answer", "")),
            }
        )
    return out


def _stragglers(doc: dict) -> list[dict]:
    out = []
    for s in (doc.get("job") or {}).get("stragglers") or []:
        if isinstance(s, dict) and isinstance(s.get("rank"), int):
            ev = s.get("evidence")
            text = s.get("message") if isinstance(s.get("message"), str) else None
            share = _num(ev.get("imposed_wait_share_of_step")) if isinstance(ev, dict) else None
            out.append({**s, "evidence_text": text or (ev if isinstance(ev, str) else _describe(ev)),
                        "wait_share": share})
    return out


def _describe(ev) -> str:
    if ev is None:
        return ""
    if isinstance(ev, dict):
        parts = []
        for k, v in ev.items():
            n = _num(v)
            parts.append(f"{k} = {n:.4g}" if n is not None else f"{k} = {v}")
        return ", ".join(parts)
    if isinstance(ev, list):
        return "; ".join(_describe(x) for x in ev[:5])
    return str(ev)


# ---------------------------------------------------------------------------- headline


def _pct(x: float | None, digits: int = 0) -> str:
    return "n/a" if x is None else f"{x * 100:.{digits}f}%"


def _rank_share(r: dict, phase: str) -> float | None:
    sh = _rank_shares(r)
    return sh[phase] if sh else None


def _headline(bound, ranks, allt, world, job_shares, tree, nccl, stragglers, doc) -> dict:
    if bound is None:
        n_steps = len(allt)
        if not ranks:
            text = "No verdict: the run directory holds no readable rank data."
        elif n_steps == 0:
            text = "No verdict: no training step was recorded (the run may have stopped before its first step)."
        else:
            text = "No verdict: steps were timed, but nothing measured where their time went."
        return {"bound": None, "title": "No verdict", "text": text}
    title = tree.verdicts[bound]["title"]
    title = title[:1].upper() + title[1:]
    agree = [r for r in ranks.values() if r["analysis"].get("bound") == bound]
    if not agree:
        agree = [r for r in ranks.values() if _mode_bound(r["t"].bound) == bound]
    n_agree, n_ranks = len(agree), len(ranks)
    if n_ranks == 0:
        where = ""
    elif n_agree == n_ranks and n_ranks == world:
        where = "" if n_ranks == 1 else " on both ranks" if n_ranks == 2 else f" on all {n_ranks} ranks"
    else:
        where = f" on {n_agree} of {world} ranks" if world > 1 else ""
    share = job_shares.get(bound) if job_shares else None
    per_rank = [x for x in (_rank_share(r, bound) for r in agree) if x is not None]
    spread = ""
    if len(per_rank) > 1 and max(per_rank) - min(per_rank) >= 0.02:
        spread = f" ({_pct(min(per_rank))}-{_pct(max(per_rank))} across ranks)"
    if share is not None:
        text = f"{title}: {PHASE_PHRASES[bound]} {_pct(share)} of step time{spread}{where}"
    else:
        text = f"{title}{where}"
    extra = []
    if bound == "comm":
        summary = nccl.get("bandwidth_summary")
        if summary:
            extra.append(summary)
        if nccl.get("log_sentences"):
            sentence = nccl["log_sentences"][0]
            # The bandwidth diagnosis may already name the same cause (e.g. TCP sockets): say it once.
            said = (summary or "").lower()
            if not any(k in said and k in sentence.lower() for k in ("tcp socket", "gpudirect", "shared memory")):
                extra.append(sentence)
        late = [s for s in stragglers if s.get("rank") is not None]
        if late:
            names = ", ".join(str(s["rank"]) for s in late[:4])
            if len(late) == 1:
                extra.append(f"rank {names} is late and the other ranks wait for it")
            else:
                extra.append(f"ranks {names} are late and the other ranks wait for them")
        job = doc.get("job") or {}
        cause = job.get("cause") if ((job.get("collectives") or {}).get("matched") or 0) > 0 else None
        if cause == "network":
            extra.append("no rank is late: the collectives themselves are slow")
        elif cause == "imbalance":
            extra.append("no single rank is late, but ranks reach the collectives at different times")
    if bound == "compute":
        mfu = _mean([r["analysis"].get("mfu") for r in ranks.values() if _num(r["analysis"].get("mfu")) is not None])
        if mfu is not None:
            extra.append(f"MFU {_pct(mfu)}")
    if bound == "data":
        waits = allt.wait[~np.isnan(allt.wait)]
        if len(waits):
            extra.append(f"median wait for a batch {np.median(waits) * 1000:.1f} ms")
    if extra:
        text += "; " + "; ".join(extra)
    return {"bound": bound, "title": title, "text": text + ".", "share": share,
            "ranks_agreeing": n_agree, "world_size": world,
            "summary": tree.verdicts[bound]["summary"]}


def _order_note(bound, recs, job_shares) -> str | None:
    """Say so when the largest expected gain is not the verdict's own phase."""
    if not bound or not recs or not job_shares or not recs[0]["id"].startswith("phase-"):
        return None
    p = recs[0]["id"][len("phase-"):]
    if p == bound:
        return None
    return (f"The verdict is {bound}-bound because the decision tree asks its questions in a fixed order "
            f"(data wait, device idle, exposed communication, then the kernel mix) and the {bound} question "
            f"answered yes first. By expected gain, though, the fixes for {PHASE_LABELS[p]} "
            f"({_pct(job_shares[p])} of the step) come first in the list below.")


def _rank_bound_from_steps(r: dict) -> str | None:
    return _mode_bound(r["t"].bound)


# ---------------------------------------------------------------------------- confidence


def _confidence(bound, allt: Steps, path, run, world) -> dict:
    """A score in [0, 1] from four factors, each explained in a sentence."""
    if bound is None:
        return {"level": "none", "score": 0.0, "reasons": ["There is no verdict to be sure of."]}
    reasons = []
    n_trace = int((allt.ev == 2).sum())
    n_all = int((allt.bound >= 0).sum())
    if n_trace:
        base = 0.9
        reasons.append(
            f"{n_trace} of the {n_all} analysed steps (counted on every rank) rest on profiler traces, which "
            "attribute every microsecond of a step to one phase; the others rest on sampled measurements."
        )
    elif n_all:
        base = 0.65
        reasons.append(
            "No profiler window was analysed: the verdict rests on sampled measurements only "
            "(step time, DataLoader wait, device utilisation), which cannot split device time "
            "into communication, memory and compute."
        )
    else:
        base = 0.5
        reasons.append("No per-step verdicts were recorded; the verdict comes from the analysis summary alone.")
    # Agreement across steps.
    codes = allt.bound[allt.bound >= 0]
    agree = float((codes == BOUND_CODE[bound]).mean()) if len(codes) else None
    factor = 1.0
    if agree is not None:
        factor *= 0.5 + 0.5 * agree
        reasons.append(f"{_pct(agree)} of analysed steps across ranks give the same verdict.")
    # Margin at the deciding node.
    if path and path.get("nodes"):
        last = path["nodes"][-1]
        v, t = last["value"], last["threshold"]
        if v is not None and t not in (None, 0) and not math.isinf(v):
            margin = abs(v - t) / abs(t)
            vs, ts = _metric_text(last["metric"], v), _metric_text(last["metric"], t)
            if margin < 0.15:
                factor *= 0.75
                reasons.append(
                    f"The deciding measurement ({last['metric']} = {vs}) is within 15% of its threshold "
                    f"({ts}): a small change could flip the verdict."
                )
            else:
                reasons.append(f"The deciding measurement ({last['metric']} = {vs}) is clear of its threshold ({ts}).")
    unknown = [n for n in (path or {}).get("nodes") or [] if n["answer"] == "unknown"]
    if unknown:
        factor *= 0.9
        reasons.append(
            "Some questions could not be answered (" + ", ".join(n["metric"] for n in unknown)
            + " not measured); the tree took their 'no' branch."
        )
    missing = list(run.get("missing_ranks") or [])
    if missing:
        factor *= max(0.5, 1 - len(missing) / max(world, 1))
        reasons.append(f"{len(missing)} of {world} rank(s) left no data; they may behave differently.")
    if run.get("problems"):
        factor *= 0.9
        reasons.append(f"{len(run['problems'])} file(s) were damaged or unreadable and were skipped.")
    score = round(base * factor, 2)
    level = "high" if score >= 0.75 else "medium" if score >= 0.5 else "low"
    return {"level": level, "score": score, "reasons": reasons}


# ---------------------------------------------------------------------------- evidence


def _metric_text(metric: str, v: float) -> str:
    if metric.endswith(("_share", "_frac", "_of_idle")) or metric in ("mfu", "scaling_efficiency"):
        return _pct(v, 1)
    return f"{v:.3g}"


def _evidence(doc, ranks, allt: Steps, steps: Steps, job_shares, stragglers, nccl) -> list[dict]:
    """Numbered facts the verdict and the recommendations point to (anchors on the page)."""
    ev = []
    if job_shares:
        n = int(steps.has_shares.sum())
        ev.append({
            "id": "ev-shares",
            "label": "Phase shares",
            "text": f"Over {n} step(s) and {len(ranks)} rank(s), start-up steps left out where the analysis "
            "marks them: "
            + ", ".join(f"{PHASE_LABELS[p]} {_pct(job_shares[p])}" for p in PHASES) + ".",
        })
    n_trace = int((steps.ev == 2).sum())
    n_windows = sum(len(r["windows"]) for r in ranks.values())
    ev.append({
        "id": "ev-sources",
        "label": "What was measured",
        "text": f"{len(steps)} step(s) timed; {n_trace} step(s) covered by profiler traces "
        f"({n_windows} analysed window(s) across ranks); "
        f"{sum(len(r['samples']) for r in ranks.values())} device/host metric sample(s).",
    })
    with np.errstate(invalid="ignore", divide="ignore"):
        waits = allt.wait / allt.dur
    waits = waits[np.isfinite(waits)]
    if len(waits):
        ev.append({
            "id": "ev-data-wait",
            "label": "DataLoader wait",
            "text": f"Median wait for the next batch is {_pct(float(np.median(waits)))} of the step "
            f"(90th percentile {_pct(float(np.percentile(waits, 90)))}), timed by agent.loader().",
        })
    for s in stragglers:
        ev.append({"id": f"ev-straggler-{s['rank']}", "label": f"Straggler rank {s['rank']}",
                   "text": s["evidence_text"] or "named by the cross-rank analysis"})
    if nccl.get("bandwidth_summary"):
        ev.append({"id": "ev-busbw", "label": "Bus bandwidth", "text": nccl["bandwidth_summary"] + "."})
    for i, f in enumerate(nccl.get("log_findings") or []):
        ev.append({"id": f"ev-nccl-{i}", "label": f"NCCL log: {f.get('id', '')}",
                   "text": str(f.get("message", "")), "lines": [str(x) for x in (f.get("evidence") or [])][:5]})
    gt = [r["analysis"].get("gpu_time") for r in ranks.values() if isinstance(r["analysis"].get("gpu_time"), dict)]
    if gt:
        idle = _mean([_num(g.get("idle_pct")) for g in gt])
        comp = _mean([_num(g.get("compute_pct")) for g in gt])
        ov = _mean([_num(g.get("comm_compute_overlap_pct")) for g in gt])
        parts = []
        if idle is not None:
            parts.append(f"device idle {idle:.1f}%")
        if comp is not None:
            parts.append(f"compute {comp:.1f}%")
        if ov is not None:
            parts.append(f"communication overlapped by compute {ov:.1f}%")
        if parts:
            ev.append({"id": "ev-gpu-time", "label": "GPU time breakdown (HTA definitions)",
                       "text": "Mean over traced ranks: " + ", ".join(parts) + "."})
    for i, f in enumerate(_findings(doc, ranks)):
        # Shown in the findings table (which carries the anchor), not repeated in the evidence list.
        ev.append({"id": f"ev-finding-{i}", "label": f"Finding: {f['id']}", "text": f["message"], "kind": "finding"})
    return ev


# ---------------------------------------------------------------------------- recommendations


def _recommendations(bound, job_shares, tree, doc, ranks, stragglers, nccl, memory, evidence) -> list[dict]:
    ev_ids = {e["id"] for e in evidence}
    recs = []
    seen_phases = set()
    if job_shares:
        # The verdict's phase first, then other phases large enough to matter (>= 10% of the step).
        order = [bound] if bound else []
        order += [p for p in sorted(PHASES, key=lambda p: -job_shares[p]) if p != bound]
        for p in order:
            share = job_shares[p]
            if p != bound and share < 0.10:
                continue
            if p == "compute" and p != bound:
                continue  # compute time is the work itself; only advise on it when it bounds the step
            seen_phases.add(p)
            refs = ["ev-shares"] + (["ev-data-wait"] if p == "data" and "ev-data-wait" in ev_ids else [])
            if p == "comm":
                refs += [e for e in ev_ids if e.startswith(("ev-busbw", "ev-nccl-", "ev-straggler-"))]
            why = f"{PHASE_LABELS[p].capitalize()}: {_pct(share)} of step time."
            if p == "comm":
                # The cross-rank diagnosis says why communication is exposed; it belongs here.
                for f in (doc.get("job") or {}).get("findings") or []:
                    if isinstance(f, dict) and f.get("id") in COMM_CAUSE_FINDINGS and f.get("message"):
                        why += " " + str(f["message"])
            frac = RECOVERABLE[p]
            recs.append({
                "id": f"phase-{p}",
                "title": _phase_title(p, share),
                "actions": list(tree.verdicts[p]["fixes"]),
                "gain_share": share * frac if frac else None,
                "gain_max_share": share,
                "gain": _phase_gain_text(p, share, frac),
                "evidence": sorted(set(refs)),
                "why": why,
                "primary": p == bound,
            })
    for s in stragglers:
        wait = _num(s.get("wait_share")) or _num(s.get("others_wait_share"))
        recs.append({
            "id": f"straggler-{s['rank']}",
            "title": f"Find out why rank {s['rank']} is late",
            "actions": [
                f"Compare rank {s['rank']}'s host and device metrics with the others (the timelines below): "
                "thermal or power throttling, a busy CPU, a slow disk or DataLoader.",
                "Check that every rank gets the same amount of work (uneven batches, sequence lengths).",
                "If the late rank's device is throttled or faulty, exclude that node.",
            ],
            "gain_share": wait,
            "gain_max_share": wait,
            "gain": (_gain_text(wait) + " (the time the other ranks spend waiting for it)") if wait is not None
            else "The other ranks' waiting time at collectives would shrink; not quantified",
            "evidence": [f"ev-straggler-{s['rank']}"],
            "why": f"Rank {s['rank']} is named as a straggler: {s['evidence_text']}",
            "primary": False,
        })
    frac = nccl.get("busbw_fraction")
    if frac is not None and frac < 0.8 and job_shares and job_shares["comm"] > 0.02:
        gain = job_shares["comm"] * (1 - frac)
        recs.append({
            "id": "nccl-bandwidth",
            "title": "Bring collective bandwidth up to what the network can do",
            "actions": [
                "Read the NCCL transport lines below: NET/Socket between nodes means InfiniBand/RoCE is not used.",
                "Check NCCL_IB_HCA, NCCL_SOCKET_IFNAME and GPUDirect RDMA (NCCL_NET_GDR_LEVEL).",
                "Re-run `diag nccl` after each change to see the bus bandwidth move.",
            ],
            "gain_share": gain,
            "gain_max_share": gain,
            "gain": _gain_text(gain) + f" (communication at the expected bandwidth would take {_pct(frac)} "
            "of its current time)",
            "evidence": sorted(e for e in ev_ids if e.startswith(("ev-busbw", "ev-nccl-"))),
            "why": nccl.get("bandwidth_summary", ""),
            "primary": False,
        })
    comm = job_shares["comm"] if job_shares else None
    for i, f in enumerate(nccl.get("log_findings") or []):
        if f["severity"] not in ("critical", "error", "warning") or not f.get("advice"):
            continue
        bound_text = (f"at most the exposed communication, {_pct(comm)} of step time" if comm is not None
                      else "not quantified")
        recs.append({
            "id": f"nccl-{f['id']}",
            "title": f"Fix NCCL: {f.get('summary') or f['message']}",
            "actions": [f["advice"]],
            "gain_share": None,
            "gain": f"Faster collectives; {bound_text}",
            "evidence": [f"ev-nccl-{i}"],
            "why": f["message"],
            "primary": False,
        })
    covered = {"comm_share_notable", "straggler"} | (COMM_CAUSE_FINDINGS if "comm" in seen_phases else set())
    for i, f in enumerate(_findings(doc, ranks)):
        if not f.get("advice") or f["id"] in covered:
            continue
        recs.append({
            "id": f"finding-{f['id']}",
            "title": _short(f["message"]),
            "actions": [f["advice"]],
            "gain_share": None,
            "gain": "Not quantified from these measurements",
            "evidence": [f"ev-finding-{i}"],
            "why": f["message"],
            "primary": False,
        })
    if memory.get("advice") and not any(r["id"] == "finding-low_memory_use" for r in recs):
        recs.append({
            "id": "memory-capacity",
            "title": memory["advice"]["title"],
            "actions": memory["advice"]["actions"],
            "gain_share": None,
            "gain": memory["advice"]["gain"],
            "evidence": ["memory"],
            "why": memory["advice"]["why"],
            "primary": False,
        })
    # Ranked by expected gain; the verdict's own fixes lead among equal gains; unquantified last.
    recs.sort(key=lambda r: (r["gain_share"] is None, -(r["gain_share"] or 0), not r["primary"]))
    for i, r in enumerate(recs, 1):
        r["rank"] = i
    return recs


# Share of a phase that its fixes typically win back: the basis of "expected gain".
# data 0.9: more workers, pinned memory and prefetch usually hide nearly all of the wait;
# comm 0.8: overlap and bucketing hide most exposed communication, the last bucket stays exposed;
# host 0.7: CUDA graphs / torch.compile remove launch and sync overhead, some Python remains;
# memory 0.5: fusion and bf16 roughly halve the bytes bandwidth-bound kernels move;
# compute: the useful work itself; not estimated.
RECOVERABLE = {"data": 0.9, "comm": 0.8, "host": 0.7, "memory": 0.5, "compute": None}
# Cross-rank findings that explain exposed communication (shown with the comm recommendation).
COMM_CAUSE_FINDINGS = {"slow_collectives", "straggler_induced_comm", "unsynchronised_arrival"}


def _phase_gain_text(p: str, share: float, frac: float | None) -> str:
    if frac is None:
        return ("Compute is the useful work; gains come from doing it faster (lower precision, tensor cores) "
                "or doing less of it, not from removing it")
    g = share * frac
    return (f"About {_pct(g)} of step time, {1 / (1 - g):.2f}x faster steps: these fixes typically win back "
            f"{frac:.0%} of the {_pct(share)} spent on {PHASE_LABELS[p]} (at most all of it, "
            f"{1 / (1 - share) if share < 0.99 else math.inf:.2f}x)")


def _phase_title(p: str, share: float) -> str:
    return {
        "data": "Feed the device faster: cut the wait for data",
        "host": "Remove host overhead: synchronisation points and launch-bound small ops",
        "comm": "Hide or shrink communication",
        "memory": "Fuse bandwidth-bound kernels",
        "compute": "Make the compute itself cheaper",
    }[p]


def _short(msg: str, limit: int = 110) -> str:
    """A title from a finding's message: its first clause, or the message cut at a word."""
    for sep in (": ", ". ", "; "):
        i = msg.find(sep)
        if 20 <= i <= limit:
            return msg[:i]
    return msg if len(msg) <= limit else msg[:limit].rsplit(" ", 1)[0] + " ..."


def _gain_text(share: float | None) -> str:
    if share is None:
        return "Not quantified"
    speedup = 1 / (1 - share) if share < 0.99 else math.inf
    sp = "more than 100x" if math.isinf(speedup) else f"{speedup:.2f}x"
    return f"Up to {_pct(share)} of step time, a step speed-up of up to {sp}"


# ---------------------------------------------------------------------------- findings, memory


def _findings(doc: dict, ranks: dict) -> list[dict]:
    """Findings of the job and of the ranks, one entry per id with the ranks it fired on."""
    merged: dict[str, dict] = {}
    sources = [(None, f) for f in (doc.get("job") or {}).get("findings") or []]
    for r in ranks.values():
        sources += [(r["rank"], f) for f in r["analysis"].get("findings") or []]
    for rank, f in sources:
        if not isinstance(f, dict):
            continue
        fid = str(f.get("id") or "finding")
        cur = merged.get(fid)
        if cur is None:
            cur = merged[fid] = {
                "id": fid,
                "severity": str(f.get("severity") or "info"),
                "message": _cap(str(f.get("message") or fid)),
                "advice": str(f.get("advice") or ""),
                "evidence": _describe(f.get("evidence")),
                "ranks": [],
            }
        if rank is not None:
            cur["ranks"].append(rank)
    order = {"critical": 0, "error": 0, "warning": 1, "info": 2}
    return sorted(merged.values(), key=lambda f: (order.get(f["severity"], 3), f["id"]))


def _cap(text: str, limit: int = 600) -> str:
    """Long messages (a finding listing hundreds of ranks) are cut for the page; the analysis JSON has them whole."""
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0] + f" ... ({len(text) - limit} more characters in the analysis JSON)"


def _memory_section(ranks: dict, tree) -> dict:
    peak = {}
    cap = {}
    for r in ranks.values():
        # The larger of torch's peak allocation and NVML's memory in use (which includes the
        # caching allocator's reserve): what the device really had to hold.
        p = r["t"].peak[~np.isnan(r["t"].peak)]
        if len(p):
            peak[r["rank"]] = float(p.max())
        gpus = [s.get("gpu") for s in r["samples"] if isinstance(s.get("gpu"), dict)]
        caps = [c for c in (_num(g.get("memory_total_bytes")) for g in gpus) if c]
        used = [u for u in (_num(g.get("memory_used_bytes")) for g in gpus) if u is not None]
        if caps:
            cap[r["rank"]] = max(caps)
        if used:
            peak[r["rank"]] = max(peak.get(r["rank"], 0.0), max(used))
        if r["rank"] not in cap:
            dev = r["info"].get("device") if isinstance(r["info"].get("device"), dict) else {}
            c = _num(dev.get("memory_total_bytes")) or _num(r["info"].get("device_memory_total_bytes"))
            if c:
                cap[r["rank"]] = c
    out = {"peak_bytes": max(peak.values()) if peak else None,
           "capacity_bytes": min(cap.values()) if cap else None, "advice": None, "text": None}
    fracs = [peak[k] / cap[k] for k in peak if k in cap and cap[k] > 0]
    if not peak:
        out["text"] = ("No device memory figures were recorded (a CPU-only run, or neither "
                       "torch.cuda memory statistics nor NVML were available).")
        return out
    if not fracs:
        out["text"] = (f"Peak device memory allocated is {_gib(out['peak_bytes'])}; the device's capacity "
                       "is unknown (no NVML samples), so no capacity advice can be given.")
        return out
    hi, lo = max(fracs), min(fracs)
    out["used_fraction_max"] = hi
    out["used_fraction_min"] = lo
    limit = tree.thresholds.get("memory_capacity", 0.8)
    out["text"] = (f"Peak device memory is {_gib(out['peak_bytes'])} of {_gib(out['capacity_bytes'])} "
                   f"({_pct(hi)} on the fullest rank, {_pct(lo)} on the emptiest).")
    if hi < limit:
        out["advice"] = {
            "title": "Use the free device memory: raise the batch size",
            "actions": [
                f"Raise the per-device batch (or micro-batch) until peak memory nears 80-90% of capacity; "
                f"today the fullest rank uses {_pct(hi)}.",
                "Keep the global batch fixed by lowering gradient-accumulation steps, if you use them.",
            ],
            "gain": "Fewer, larger kernels and fewer optimizer and communication rounds per sample; "
                    "not quantified from these measurements",
            "why": f"Device memory use peaks at {_pct(hi)} of capacity, below {_pct(limit)}.",
        }
    elif hi >= 0.95:
        out["advice"] = {
            "title": "Device memory is nearly full: make room before it fails or slows down",
            "actions": [
                "Enable activation checkpointing on the largest blocks, or shard optimizer state (ZeRO/FSDP).",
                "Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to reduce fragmentation.",
                "Lower the micro-batch and raise gradient accumulation to keep the global batch.",
            ],
            "gain": "Avoids out-of-memory failures and allocator retries (cudaFree/cudaMalloc stalls); "
                    "not quantified",
            "why": f"Device memory use peaks at {_pct(hi)} of capacity.",
        }
    return out


def _gib(b) -> str:
    return "n/a" if b is None else f"{b / 2**30:.2f} GiB"


# ---------------------------------------------------------------------------- NCCL


def _nccl_section(run: dict) -> dict:
    out: dict = {}
    log = run.get("nccl_log") if isinstance(run.get("nccl_log"), dict) else None
    bench = run.get("nccl_bench") if isinstance(run.get("nccl_bench"), dict) else None
    if log:
        out["version"] = log.get("nccl_version")
        out["hosts"] = [str(h) for h in (log.get("hosts") or [])][:64] if isinstance(log.get("hosts"), list) \
            else [str(h) for h in (log.get("hosts") or {})][:64]
        out["transports"] = _transport_rows(log.get("transports"))
        out["log_findings"] = [
            {"id": str(f.get("id", "")), "severity": str(f.get("severity", "info")),
             "message": str(f.get("message", "")), "evidence": [str(x) for x in (f.get("evidence") or [])][:5],
             "advice": str(f.get("advice") or ""), "summary": str(f.get("summary") or "")}
            for f in log.get("findings") or [] if isinstance(f, dict)
        ]
        out["warnings"] = [str(w.get("message", w)) if isinstance(w, dict) else str(w)
                           for w in (log.get("warnings") or [])][:20]
    if isinstance(run.get("nccl_log_summary"), list):
        out["log_sentences"] = [str(x) for x in run["nccl_log_summary"] if x][:5]
    if bench:
        chart = {"series": [], "expected": []}
        for t in bench.get("tests") or []:
            if not isinstance(t, dict):
                continue
            xs, ys = [], []
            for row in t.get("rows") or []:
                oop = row.get("out_of_place") or {}
                x, y = _num(row.get("size_bytes")), _num(oop.get("busbw_gbps"))
                if y is None:
                    y = _num((row.get("in_place") or {}).get("busbw_gbps"))
                if x is not None and y is not None:
                    xs.append(x)
                    ys.append(y)
            if xs:
                chart["series"].append({
                    "name": f"{t.get('collective', '?')} ({t.get('world_size', '?')} ranks, "
                            f"{t.get('backend', '?')})",
                    "collective": str(t.get("collective", "")),
                    "x": xs, "y": ys, "status": str(t.get("status", "ok")),
                })
        interp = [i for i in run.get("nccl_interpretation") or [] if isinstance(i, dict)]
        for i in interp:
            e = _num(i.get("expected_busbw_gbps"))
            if e and not any(x["busbw_gbps"] == e for x in chart["expected"]):
                chart["expected"].append({"collective": str(i.get("collective", "")), "busbw_gbps": e,
                                          "label": str(i.get("expected_basis") or "expected")})
        if chart["series"]:
            out["busbw_chart"] = chart
            out["bench_tests"] = [{"collective": s["collective"], "name": s["name"], "status": s["status"],
                                   "max_busbw_gbps": max(s["y"])} for s in chart["series"]]
        # The headline figure: all_reduce first (what data-parallel training uses), else the first test.
        rated = [i for i in interp if _num(i.get("pct_of_expected")) is not None]
        rated.sort(key=lambda i: i.get("collective") != "all_reduce")
        if rated:
            best = rated[0]
            out["busbw_fraction"] = best["pct_of_expected"] / 100.0
            out["bandwidth_summary"] = (f"{best.get('collective') or 'collective'} bus bandwidth "
                                        f"{best['measured_busbw_gbps']:.1f} GB/s, {best.get('diagnosis')}")
        elif interp and interp[0].get("diagnosis"):
            out["bandwidth_note"] = (f"{interp[0].get('collective') or 'collective'} bus bandwidth: "
                                     f"{interp[0]['diagnosis']}")
    return out


def _transport_rows(t) -> list[dict]:
    rows = []
    if isinstance(t, dict) and isinstance(t.get("by_kind"), dict):
        # diag.nccl_log/1: connection counts per transport kind, plus GPUDirect RDMA and NICs.
        for kind, n in sorted(t["by_kind"].items(), key=lambda kv: -(_num(kv[1]) or 0))[:20]:
            rows.append({"transport": str(kind), "detail": f"{n} connection(s)"})
        extra = []
        for key, label in (("gdrdma", "with GPUDirect RDMA"), ("no_gdrdma", "network connections without "
                                                                             "GPUDirect RDMA"), ("pxn", "via PXN")):
            if _num(t.get(key)):
                extra.append(f"{int(t[key])} {label}")
        if extra:
            rows.append({"transport": "network detail", "detail": ", ".join(extra)})
        nics = t.get("nics") or t.get("network")
        if isinstance(nics, list) and nics:
            rows.append({"transport": "NICs", "detail": ", ".join(_describe(x) if isinstance(x, dict) else str(x)
                                                                 for x in nics[:8])})
        return rows
    if isinstance(t, dict):
        for k, v in list(t.items())[:50]:
            rows.append({"transport": str(k), "detail": _describe(v) if not isinstance(v, (int, float, str))
                         else str(v)})
    elif isinstance(t, list):
        for x in t[:50]:
            if isinstance(x, dict):
                name = x.get("transport") or x.get("kind") or x.get("type") or "?"
                detail = ", ".join(f"{k}={v}" for k, v in x.items()
                                   if k not in ("transport", "kind", "type") and isinstance(v, (str, int, float)))
                rows.append({"transport": str(name), "detail": detail})
            else:
                rows.append({"transport": str(x), "detail": ""})
    return rows


# ---------------------------------------------------------------------------- charts


def _edges(n: int, k: int) -> np.ndarray:
    """Start indices of at most k contiguous, near-equal buckets over range(n)."""
    if n <= k:
        return np.arange(n)
    return np.unique(np.linspace(0, n, k + 1).astype(int)[:-1])


def _bucket_mean(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """NaN-aware mean of consecutive buckets (along axis 0), NaN where a bucket has no value."""
    ok = ~np.isnan(values)
    sums = np.add.reduceat(np.where(ok, values, 0.0), starts, axis=0)
    cnt = np.add.reduceat(ok.astype(np.float64), starts, axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(cnt > 0, sums / np.maximum(cnt, 1), np.nan)


def _list(a: np.ndarray, digits: int = 4) -> list:
    """Array to a JSON list, NaN as null."""
    return [None if v != v else round(float(v), digits) for v in a.tolist()]


def _phase_series(steps: Steps, limits, notes) -> dict | None:
    m = steps.has_shares
    if not m.any():
        return None
    st, sh, ev = steps.step[m], steps.shares[m], steps.ev[m]
    starts = _edges(len(st), limits.series_points)
    if len(starts) < len(st):
        notes.append(f"Phase shares: {len(st)} steps are shown as {len(starts)} buckets of consecutive steps "
                     "(each bar is the mean of its bucket).")
    means = _bucket_mean(sh, starts)
    trace = np.maximum.reduceat(ev, starts) == 2
    return {"x": st[starts].tolist(), "y": {p: _list(means[:, i]) for i, p in enumerate(PHASES)},
            "evidence": ["trace" if t else "sampled" for t in trace.tolist()], "bucketed": len(starts) < len(st)}


def _throughput_series(ranks, steps: Steps, limits, notes) -> dict | None:
    m = ~np.isnan(steps.dur)
    if not m.any():
        return None
    st, dur = steps.step[m], steps.dur[m]
    starts = _edges(len(st), limits.series_points)
    out = {"x": st[starts].tolist(), "step_ms": _list(_bucket_mean(dur, starts) * 1000, 3),
           "samples_per_s": None, "tokens_per_s": None, "mfu": None}
    tot = np.add.reduceat(dur, starts)
    for key, col in (("samples_per_s", steps.samples[m]), ("tokens_per_s", steps.tokens[m])):
        if np.nansum(col) > 0:
            out[key] = _list(np.add.reduceat(np.nan_to_num(col), starts) / tot, 3)
    if not np.isnan(steps.mfu[m]).all():
        out["mfu"] = _list(_bucket_mean(steps.mfu[m], starts))
    else:
        # MFU from analysed windows: one point per window start, mean over ranks.
        by_step = defaultdict(list)
        for r in ranks.values():
            for w in r["windows"]:
                a = w.get("analysis") if isinstance(w.get("analysis"), dict) else {}
                v = _num(a.get("mfu"))
                if v is not None and isinstance(w.get("first_step"), int):
                    by_step[w["first_step"]].append(v)
        if by_step:
            out["mfu_points"] = {"x": sorted(by_step), "y": [float(np.mean(by_step[k])) for k in sorted(by_step)]}
    return out


def _step_heatmap(ranks, limits, notes) -> dict | None:
    rows = [r for r in ranks.values() if (~np.isnan(r["t"].dur)).any()]
    if not rows:
        return None
    all_steps = np.unique(np.concatenate([r["t"].step[~np.isnan(r["t"].dur)] for r in rows]))
    grid = np.full((len(rows), len(all_steps)), np.nan)
    for i, r in enumerate(rows):
        m = ~np.isnan(r["t"].dur)
        grid[i, np.searchsorted(all_steps, r["t"].step[m])] = r["t"].dur[m] * 1000
    starts = _edges(len(all_steps), limits.heatmap_columns)
    if len(starts) < len(all_steps):
        notes.append(f"Step-time heatmap: {len(all_steps)} steps per rank are shown as {len(starts)} columns "
                     "(each cell is the mean step time of its bucket).")
    z = _bucket_mean(grid.T, starts).T
    return {"x": all_steps[starts].tolist(), "ranks": [r["rank"] for r in rows],
            "z": [_list(row, 3) for row in z], "unit": "ms", "label": "step time"}


def _bucket_cols(grid: np.ndarray, starts: np.ndarray) -> list:
    return [_list(row, 3) for row in _bucket_mean(grid.T, starts).T]


def _wait_heatmap(doc, ranks, limits, notes) -> dict | None:
    """Waiting time per collective per rank: its duration minus the fastest rank's duration.

    Collectives are matched across ranks by the cross-rank analyzer (process group and
    sequence number, falling back to order), the same matching the job verdict uses.
    """
    per_rank = {r["rank"]: r["analysis"]["collectives"] for r in ranks.values()
                if isinstance(r["analysis"].get("collectives"), list) and r["analysis"]["collectives"]}
    if len(per_rank) < 2:
        return None
    try:
        from diag.analyzers.job.cross_rank import match_collectives
    except ImportError:
        return None
    groups = match_collectives(per_rank)["groups"]
    if not groups:
        return None
    rank_list = sorted(per_rank)
    row = {r: i for i, r in enumerate(rank_list)}
    wait = np.full((len(rank_list), len(groups)), np.nan)
    for j, g in enumerate(groups):
        fastest = min(g["dur_us"].values())
        for r, d in g["dur_us"].items():
            if r in row:
                wait[row[r], j] = (d - fastest) / 1000.0  # ms
    starts = _edges(len(groups), limits.heatmap_columns)
    if len(starts) < len(groups):
        notes.append(f"Collective-wait heatmap: {len(groups)} matched collectives are shown as {len(starts)} "
                     "columns (each cell is the mean wait of its bucket).")
    z = _bucket_cols(wait, starts)
    totals = np.nansum(wait, axis=1)
    return {"x": starts.tolist(), "ranks": rank_list, "z": z, "unit": "ms",
            "label": "wait at collectives", "collectives": len(groups),
            "total_wait_ms": {str(r): round(float(t), 3) for r, t in zip(rank_list, totals)}}


# (key, label, unit, section of the sample, field, scale): the metric timelines, in page order.
TIMELINE_METRICS = (
    ("gpu_util", "Device utilisation", "%", "gpu", "utilization_ratio", 100.0),
    ("gpu_mem", "Device memory used", "GiB", "gpu", "memory_used_bytes", 1 / 2**30),
    ("gpu_power", "Device power", "W", "gpu", "power_watts", 1.0),
    ("gpu_clock", "SM clock", "MHz", "gpu", "sm_clock_hz", 1e-6),
    ("gpu_temp", "Device temperature", "°C", "gpu", "temperature_celsius", 1.0),
    ("host_cpu", "Host CPU", "%", "host", "cpu_ratio", 100.0),
    ("proc_cpu", "Training process CPU", "% of one core", "host", "process_cpu_ratio", 100.0),
    ("host_mem", "Host memory used", "GiB", "host", "memory_used_bytes", 1 / 2**30),
    ("proc_rss", "Training process memory (RSS)", "GiB", "host", "process_rss_bytes", 1 / 2**30),
)


def _sample_matrix(samples: list) -> tuple[np.ndarray, np.ndarray, list]:
    """(times, values per TIMELINE_METRICS column, [(t, reasons)] throttle events) of one rank."""
    ts, rows, throttle = [], [], []
    for s in samples:
        t = _f(s.get("t"))
        if t != t:
            continue
        g = s.get("gpu") if type(s.get("gpu")) is dict else {}
        h = s.get("host") if type(s.get("host")) is dict else {}
        ts.append(t)
        rows.append([_f((g if sec == "gpu" else h).get(field)) * k for _, _, _, sec, field, k in TIMELINE_METRICS])
        ce = g.get("clock_events")
        if type(ce) is list and ce:
            bad = sorted({str(x) for x in ce} - BENIGN_CLOCK_EVENTS)
            if bad:
                throttle.append((t, ",".join(bad)))
    if not ts:
        return np.empty(0), np.empty((0, len(TIMELINE_METRICS))), throttle
    vals = np.array(rows, dtype=np.float64)
    vals[~np.isfinite(vals)] = np.nan
    return np.array(ts), vals, throttle


def _timelines(ranks, limits, notes) -> dict | None:
    """Device and host metrics over time; bands across ranks when there are many."""
    per = {r["rank"]: _sample_matrix(r["samples"]) for r in ranks.values() if r["samples"]}
    per = {k: v for k, v in per.items() if len(v[0])}
    if not per:
        return None
    t0 = min(float(v[0].min()) for v in per.values())
    band = len(per) > limits.rank_lines
    out = {"t0_unix": t0, "band": band, "metrics": [], "throttle": []}
    if band:
        notes.append(f"Metric timelines: {len(per)} ranks are shown as the min, median and max across ranks "
                     f"per time bucket (at most {limits.timeline_points} buckets).")
    downsampled = False
    for j, (key, label, unit, _sec, _field, _k) in enumerate(TIMELINE_METRICS):
        series = {}
        for rank, (ts, vals, _) in per.items():
            m = ~np.isnan(vals[:, j])
            if m.any():
                series[rank] = (ts[m] - t0, vals[m, j])
        if not series:
            continue
        entry = {"key": key, "label": label, "unit": unit}
        if band:
            entry.update(_band(series, limits.timeline_points))
        else:
            lines = []
            for rank, (t, v) in sorted(series.items()):
                if len(t) > limits.timeline_points:
                    downsampled = True
                    starts = _edges(len(t), limits.timeline_points)
                    t, v = t[starts], _bucket_mean(v, starts)
                lines.append({"rank": rank, "t": _list(t, 3), "y": _list(v)})
            entry["lines"] = lines
        out["metrics"].append(entry)
    if downsampled:
        notes.append(f"Metric timelines: series longer than {limits.timeline_points} samples are averaged "
                     "into that many points.")
    # Throttle events: one marker per second and reason, naming the ranks it hit.
    events: dict[tuple, list] = defaultdict(list)
    for rank, (_, _, thr) in per.items():
        for t, reasons in thr:
            events[(round(t - t0), reasons)].append(rank)
    throttle = [{"t": k[0], "reasons": k[1], "ranks": sorted(v)} for k, v in sorted(events.items())]
    out["throttle_total"] = sum(len(v) for v in events.values())
    if len(throttle) > limits.timeline_points:
        notes.append(f"Throttle events: {len(throttle)} distinct seconds with throttling; the first "
                     f"{limits.timeline_points} are marked.")
        throttle = throttle[: limits.timeline_points]
    out["throttle"] = throttle
    return out if out["metrics"] else None


def _scaled(v, k) -> float | None:
    n = _num(v)
    return None if n is None else n * k


def _band(series: dict, points: int) -> dict:
    t = np.concatenate([v[0] for v in series.values()])
    v = np.concatenate([v[1] for v in series.values()])
    lo, hi = float(t.min()), float(t.max())
    nb = max(1, min(points, int(hi - lo) + 1))
    idx = np.minimum(((t - lo) / max(hi - lo, 1e-9) * nb).astype(int), nb - 1)
    order = np.lexsort((v, idx))
    idx, v = idx[order], v[order]
    cuts = np.flatnonzero(np.diff(idx)) + 1
    starts = np.r_[0, cuts]
    ends = np.r_[cuts, len(v)]
    med = [(float(v[(a + b - 1) // 2]) + float(v[(a + b) // 2])) / 2 for a, b in zip(starts, ends)]
    centers = lo + (idx[starts] + 0.5) * (hi - lo) / nb
    return {"t": _list(centers, 3), "min": _list(v[starts]), "median": [round(x, 4) for x in med],
            "max": _list(v[ends - 1])}


# ---------------------------------------------------------------------------- tables, summary


def _top_table(doc: dict, key: str, limits: Limits) -> list[dict]:
    """Kernels or ops merged across ranks: mean time per rank that ran them."""
    acc: dict[str, dict] = {}
    n_ranks = 0
    for r in doc.get("ranks") or []:
        rows = r.get(key) if isinstance(r, dict) else None
        if not isinstance(rows, list) or not rows:
            continue
        n_ranks += 1
        for row in rows:
            if not isinstance(row, dict):
                continue
            name = str(row.get("name", "?"))
            a = acc.setdefault(name, {"name": name, "class": str(row.get("class") or ""), "time_ms": 0.0,
                                      "count": 0, "pct": [], "intensity": [], "ranks": 0})
            a["time_ms"] += _num(row.get("time_ms")) or 0.0
            a["count"] += int(_num(row.get("count")) or 0)
            if _num(row.get("pct")) is not None:
                a["pct"].append(row["pct"])
            if _num(row.get("intensity")) is not None:
                a["intensity"].append(row["intensity"])
            a["ranks"] += 1
    out = []
    for a in acc.values():
        out.append({
            "name": a["name"], "class": a["class"], "time_ms": a["time_ms"] / max(a["ranks"], 1),
            "count": a["count"], "pct": _mean(a["pct"]), "intensity": _mean(a["intensity"]),
            "ranks": a["ranks"],
        })
    out.sort(key=lambda x: -x["time_ms"])
    return out[: limits.table_rows]


def _rank_rows(ranks, stragglers, limits, notes) -> list[dict]:
    late = {s["rank"] for s in stragglers}
    rows = []
    for r in ranks.values():
        durs = r["t"].dur[~np.isnan(r["t"].dur)]
        sh = _rank_shares(r)
        bound = r["analysis"].get("bound") if r["analysis"].get("bound") in PHASES else _rank_bound_from_steps(r)
        rows.append({
            "rank": r["rank"], "host": r["host"], "device": r["device"], "bound": bound,
            "steps": len(r["t"]),
            "median_step_ms": float(np.median(durs)) * 1000 if len(durs) else None,
            "shares": sh,
            "trace_steps": int((r["t"].ev == 2).sum()),
            "windows": len(r["windows"]), "samples": len(r["samples"]),
            "straggler": r["rank"] in late,
            "mfu": _num(r["analysis"].get("mfu")),
        })
    if len(rows) > limits.rank_rows:
        notes.append(f"Per-rank table: {len(rows)} ranks; the {limits.rank_rows} slowest are listed.")
        rows.sort(key=lambda x: -(x["median_step_ms"] or 0))
        rows = sorted(rows[: limits.rank_rows], key=lambda x: x["rank"])
    return rows


def _step_stats(steps: Steps) -> dict | None:
    d = steps.dur[~np.isnan(steps.dur)]
    if not len(d):
        return None
    med = float(np.median(d))
    return {"steps": int(len(d)), "median_ms": med * 1000, "mad_ms": float(np.median(np.abs(d - med))) * 1000,
            "p10_ms": float(np.percentile(d, 10)) * 1000, "p90_ms": float(np.percentile(d, 90)) * 1000,
            "mean_ms": float(d.mean()) * 1000, "total_s": float(d.sum())}


def _throughput_summary(ranks, steps: Steps) -> dict:
    """Job throughput: units summed over ranks per step, over the job's (slowest rank's) step time."""
    m = ~np.isnan(steps.dur)
    out = {"steps_per_s": None, "samples_per_s": None, "tokens_per_s": None, "mfu": None}
    if not m.any():
        return out
    total = float(steps.dur[m].sum())
    out["steps_per_s"] = int(m.sum()) / total
    for key, col in (("samples_per_s", steps.samples[m]), ("tokens_per_s", steps.tokens[m])):
        if np.nansum(col) > 0:
            out[key] = float(np.nansum(col)) / total
    mfu = steps.mfu[m & ~np.isnan(steps.mfu)]
    if len(mfu):
        out["mfu"] = float(mfu.mean())
    else:
        out["mfu"] = _mean([v for v in (_num(r["analysis"].get("mfu")) for r in ranks.values()) if v is not None])
    return out


def _run_meta(doc, run, ranks, world, steps) -> dict:
    man = run.get("manifest") or {}
    hosts = sorted({r["host"] for r in ranks.values() if r["host"]})
    if not hosts and isinstance(man.get("hosts"), list):
        hosts = [str(h if not isinstance(h, dict) else h.get("hostname", h.get("host", "?")))
                 for h in man["hosts"]]
    devices = Counter(r["device"] for r in ranks.values() if r["device"])
    return {
        "path": run.get("path"),
        "name": man.get("run") or man.get("name") or _name_from(run.get("path") or doc.get("source"), ranks),
        "world_size": world,
        "ranks_present": sorted(ranks),
        "missing_ranks": list(run.get("missing_ranks") or []),
        "hosts": hosts[:64],
        "host_count": len(hosts),
        "devices": [f"{n} x {d}" for d, n in devices.most_common()],
        "backend": _backend(run, ranks),
        "nccl_applicable": _nccl_applicable(run, ranks),
        "start_unix": _num(man.get("started_unix")) or _num(man.get("start_unix")),
        "end_unix": _num(man.get("ended_unix")) or _num(man.get("end_unix")),
        "steps": int(len(steps)),
        "sources": sorted({str(r["analysis"].get("source")) for r in ranks.values() if r["analysis"].get("source")})[:8],
    }


def _backend(run: dict, ranks: dict) -> str | None:
    man = run.get("manifest") or {}
    return man.get("backend") or next((r["info"].get("backend") for r in ranks.values()
                                       if r["info"].get("backend")), None)


def _nccl_applicable(run: dict, ranks: dict) -> bool:
    """False for gloo/MPI jobs and for PyTorch builds without CUDA or ROCm (they cannot use NCCL)."""
    backend = _backend(run, ranks)
    if backend:
        return str(backend).lower() in ("nccl", "rccl")
    versions = (run.get("manifest") or {}).get("versions")
    if isinstance(versions, dict) and "cuda" in versions and "hip" in versions:
        return bool(versions.get("cuda") or versions.get("hip"))
    return True


def _name_from(path, ranks: dict) -> str:
    """The run's directory name, else the trace file or folder the analysis came from."""
    if path:
        return str(path).rstrip("/").split("/")[-1]
    sources = sorted({str(r["analysis"].get("source")) for r in ranks.values() if r["analysis"].get("source")})
    if len(sources) == 1:
        return sources[0].rstrip("/").split("/")[-1]
    if sources:
        parent = sources[0].rsplit("/", 1)[0] if "/" in sources[0] else ""
        return (parent.split("/")[-1] or "traces") + f" ({len(sources)} traces)"
    return "analysis"


def _problems(doc, run) -> list[str]:
    out = [str(p) for p in run.get("problems") or []]
    for e in doc.get("errors") or []:
        if isinstance(e, dict):
            out.append(f"{e.get('source', '?')}: {e.get('error', '?')}")
    return list(dict.fromkeys(out))


# ---------------------------------------------------------------------------- missing


def _missing(run, ranks, allt: Steps, world, nccl) -> list[dict]:
    """What could not be measured, why it matters, and how to get it next time."""
    out = []
    path = run.get("path") or "RUN_DIR"
    missing = list(run.get("missing_ranks") or [])
    if missing:
        shown = ", ".join(str(r) for r in missing[:16]) + (" ..." if len(missing) > 16 else "")
        out.append({
            "what": f"Rank(s) {shown} left no data ({len(missing)} of {world}).",
            "why": "A missing rank may be the one that crashed, hung or straggled; the verdict covers only "
                   "the ranks present.",
            "how": "Check that rank's log for a crash or kill (OOM killer, NCCL timeout); make sure every "
                   "rank can write to the run directory.",
        })
    stopped = list(run.get("stopped_ranks") or [])
    if stopped:
        shown = ", ".join(str(r) for r in stopped[:16]) + (" ..." if len(stopped) > 16 else "")
        out.append({
            "what": f"Rank(s) {shown} stopped reporting before the job ended.",
            "why": "Their data ends early; a rank that dies usually makes the others fail or hang in the next "
                   "collective.",
            "how": "Check the launcher's log and the host's kernel log (OOM killer, segfault, NCCL watchdog).",
        })
    if not ranks:
        out.append({"what": "No rank data at all.", "why": "Nothing to analyse.",
                    "how": "Run the training under diag.Agent(run_dir=...) so each rank writes its folder."})
        return out
    has_trace = bool((allt.ev == 2).any()) or any(r["windows"] for r in ranks.values())
    if not has_trace and run.get("ranks"):
        out.append({
            "what": "No profiler window was captured or analysed.",
            "why": "Without a trace the device's time cannot be split into communication, bandwidth-bound "
                   "and compute kernels; verdicts rest on step time, data wait and utilisation samples.",
            "how": "Keep the agent's profiler schedule on and run past its first skipped steps, or profile a "
                   f"window on demand: touch {path}/profile.trigger (or send SIGUSR2 to the training "
                   f"process); then run `diag report {path}`.",
        })
    samples = [s for r in ranks.values() for s in r["samples"]]
    if run.get("ranks") and not samples:
        out.append({
            "what": "No device or host metric samples.",
            "why": "Utilisation, memory, power, clock and throttle timelines are empty.",
            "how": "Keep the agent's sampler enabled (1 Hz by default); on GPUs install nvidia-ml-py "
                   "(NVIDIA) or amdsmi (ROCm).",
        })
    elif samples and not any(isinstance(s.get("gpu"), dict) for s in samples):
        out.append({
            "what": "No device metrics (no NVML or amdsmi samples).",
            "why": "Device utilisation, memory, power, clocks and throttle events are unknown; on a CPU-only "
                   "run this is expected.",
            "how": "On NVIDIA GPUs install nvidia-ml-py and make libnvidia-ml visible to the process; "
                   "on AMD install amdsmi.",
        })
    if world > 1 and not nccl.get("log_findings") and not nccl.get("transports") and not nccl.get("version"):
        if not _nccl_applicable(run, ranks):
            pass  # a gloo or MPI job, or a CPU-only PyTorch build, has no NCCL log to miss
        else:
            has_logs = any(r["nccl_logs"] for r in ranks.values())
            how = ("Logs were found but could not be parsed: see the problems listed below." if has_logs else
                   "Start the agent before init_process_group (it sets NCCL_DEBUG=INFO and NCCL_DEBUG_FILE), "
                   "or launch with `diag run -- <launcher command>`.")
            out.append({
                "what": "No NCCL log.",
                "why": "Without it the report cannot say which transport (NVLink, InfiniBand, TCP sockets) "
                       "carried the collectives, or explain NCCL warnings and timeouts.",
                "how": how,
            })
    if world > 1 and not nccl.get("busbw_chart"):
        out.append({
            "what": "No bus-bandwidth measurement.",
            "why": "Without it the report cannot compare the network against what it should deliver.",
            "how": f"Run `diag nccl --nproc-per-node N --run-dir {path}` on the same nodes "
                   "(or nccl-tests, then `diag nccl parse`).",
        })
    if len(allt) and not (np.nansum(allt.samples) > 0 or np.nansum(allt.tokens) > 0):
        out.append({
            "what": "No throughput figures (samples or tokens per step).",
            "why": "Throughput over time and scaling efficiency between runs need them.",
            "how": "Pass them each step: agent.step(samples=batch_size, tokens=tokens_in_batch).",
        })
    if not any(_num(r["analysis"].get("mfu")) is not None for r in ranks.values()) and \
            np.isnan(allt.mfu).all():
        out.append({
            "what": "No MFU (model FLOPs utilisation).",
            "why": "MFU says how far the job is from the device's peak; it needs FLOPs per step.",
            "how": "Enable with_flops (and record_shapes) in the agent's profiler settings, on a device with "
                   "a known peak (or run `diag calibrate` for CPUs).",
        })
    for part, reason in sorted((run.get("unavailable") or {}).items()):
        out.append({
            "what": f"Part of diag was unavailable: {part}.",
            "why": str(reason),
            "how": "Install or update diag (pip install -U diag) and run the report again.",
        })
    if len(allt) and np.isnan(allt.wait).all():
        out.append({
            "what": "No DataLoader wait times.",
            "why": "Outside profiler windows, data-bound steps cannot be told from others.",
            "how": "Wrap the loader: `for batch in agent.loader(train_loader): ...`.",
        })
    return out
