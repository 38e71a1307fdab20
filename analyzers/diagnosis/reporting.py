"""What a job's inputs cover: which ranks are missing from it, which stopped reporting before
it ended (the one rule every consumer takes: the job findings, the ended-abnormally finding,
the headline, the report's "What was missing", confidence), and which traces claim a rank
twice, name none, or recorded different numbers of a collective.

The analysis gives facts only: the world size, the ranks with no data at all
(`job.missing_ranks`), and for a run directory each rank's last heartbeat and whether it
closed (`job.reports`, from `job.run_analysis.rank_reports`). Here:

- a rank is *missing* when the world size names it and it left no data: the finding
  `missing_ranks`, a warning (the analysis rests on the others);
- a rank is *stopped* when it left data, never closed, and either the job is over (the run
  or another rank closed) or its last heartbeat is `rank_silent_s` older than the newest one:
  its process was killed, crashed or hangs. `document.ended_finding` names it, an error.
"""

from __future__ import annotations

from diag.analyzers.analysis_types import Job
from diag.analyzers.numbers import finite


def stopped_ranks(reports: dict | None, tree) -> list[dict]:
    """The ranks of a run directory that stopped reporting before the job ended, each with
    its rank, host, last step and last heartbeat (unix seconds), in rank order."""
    if not isinstance(reports, dict):
        return []
    rows = [r for r in reports.get("ranks") or [] if isinstance(r, dict) and isinstance(r.get("rank"), int)]
    beats = [b for b in (finite(r.get("last_heartbeat_unix")) for r in rows) if b is not None]
    ended = finite(reports.get("ended_unix"))
    newest = max(beats + ([ended] if ended is not None else []), default=None)
    job_over = bool(reports.get("run_closed")) or any(r.get("closed") for r in rows)
    silent_s = tree.thresholds["rank_silent_s"]
    out = []
    for r in sorted(rows, key=lambda r: r["rank"]):
        if r.get("closed"):
            continue
        beat = finite(r.get("last_heartbeat_unix"))
        no_info = r.get("readable") is False
        if no_info or job_over or (newest is not None and (beat is None or newest - beat > silent_s)):
            out.append({"rank": r["rank"], "host": r.get("host"), "last_step": r.get("last_step"),
                        "last_heartbeat_unix": beat, "reason": "no rank.json" if no_info else "stopped reporting"})
    return out


def missing_finding(missing: list[int], world: int | None) -> dict | None:
    """The job finding for the ranks the world size names that left no data."""
    if not missing:
        return None
    return {
        "id": "missing_ranks",
        "severity": "warning",
        "message": f"{len(missing)} of {world or '?'} ranks left no data ({'rank' if len(missing) == 1 else 'ranks'} "
                   f"{_ranges(missing)}); "
                   "the job analysis rests on the other ranks.",
        "advice": "Profile every rank (or pass every rank's trace), so a straggler or a crash among the missing "
                  "ranks is not overlooked; in a run directory, a rank that never wrote could not reach it or "
                  "died before its first step (read the launcher's log).",
        "evidence": {"missing": list(missing)[:1000], "world_size": world},
    }


def input_findings(job: Job) -> list[dict]:
    """The job findings of the cross-rank facts on the traces themselves: a rank claimed twice,
    traces that name no rank, collectives the ranks recorded different numbers of."""
    out = []
    dups = [d for d in job.duplicate_ranks if isinstance(d, dict)]
    if dups:
        out.append({"id": "duplicate_ranks", "severity": "warning",
                    "message": "Several traces claim the same rank: "
                               + ", ".join(f"rank {d.get('rank')} ({d.get('source')})" for d in dups[:16])
                               + "; only the first is used.",
                    "advice": "Pass one trace per rank, from the same profiling window.",
                    "evidence": {"duplicates": dups[:1000]}})
    unnamed = list(job.unnamed_traces)
    if unnamed:
        out.append({"id": "unknown_rank", "severity": "warning",
                    "message": f"{len(unnamed)} trace(s) name no rank and are left out of the cross-rank comparison.",
                    "advice": "Name trace files with their rank (e.g. rank-3.json.gz) or profile with distributed "
                              "info enabled.",
                    "evidence": {"sources": unnamed[:1000]}})
    mismatch = [m for m in job.collectives.get("count_mismatch") or [] if isinstance(m, dict)]
    if mismatch:
        out.append({"id": "collective_count_mismatch", "severity": "info",
                    "message": "Ranks recorded different numbers of some collectives (" + "; ".join(
                        f"{m.get('name')}" + (f" of {m['bytes']} bytes" if m.get("bytes") else "")
                        + (f" on group {m['pg']}" if m.get("pg") is not None else "") + ": "
                        + ", ".join(f"rank {r}: {n}" for r, n in (m.get("counts") or {}).items())
                        for m in mismatch[:5]) + "), so matching by order may pair different calls.",
                    "advice": "Profile the same steps on every rank; a rank with fewer calls may have hung or "
                              "diverged.",
                    "evidence": {"mismatch": mismatch[:50]}})
    return out


def _ranges(ranks: list[int]) -> str:
    """0-3, 7, 9-10: consecutive ranks folded."""
    out, ranks = [], sorted(set(ranks))
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(out[:16]) + (" ..." if len(out) > 16 else "")
