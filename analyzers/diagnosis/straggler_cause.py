"""Why a straggler is late: its own time against its peers', and its device and host readings.

The cross-rank analysis names the rank the others wait for; this says what to look at on
it. Each step the straggler spends longer than its peers somewhere, and where decides:
- device work (compute and bandwidth-bound kernels) longer than the peers': a throttled
  device when its SM clock reads lower than its peers' (a power cap among them), or when it
  reports thermal or hardware slowdown in more of its samples than its peers do; else uneven
  work (larger batches or sequences, extra layers or evaluation on this rank). A power cap
  that every board reports under load is no cause by itself;
- waiting for the DataLoader longer: a slow input pipeline on this rank;
- host time longer (device idle, not waiting for data): a busy CPU when the host reads
  nearly saturated, else work outside the profiled steps (Python, I/O, logging).
Differences under `straggler_cause_min_excess` of a step are noise, and then the cause is left open.

Pure: reads the merged ranks of `inputs.merge_ranks`, returns plain data.
"""

from __future__ import annotations

import statistics

from diag.analyzers.diagnosis.inputs import num, rank_shares
from diag.analyzers.diagnosis.throttle import slowing_reasons, throttle_reasons


def _step_ms(r: dict) -> float | None:
    d = r["step_table"].dur
    d = d[d == d]
    return float(statistics.median(d.tolist())) * 1000 if len(d) else None


def _parts_ms(r: dict) -> dict | None:
    """Milliseconds per median step in data, host and device work."""
    sh, ms = rank_shares(r), _step_ms(r)
    if not sh or ms is None:
        return None
    return {"data": sh["data"] * ms, "host": sh["host"] * ms, "device": (sh["compute"] + sh["memory"]) * ms}


def _gpu(r: dict, key: str) -> list:
    return [s["gpu"].get(key) for s in r.get("samples") or [] if isinstance(s.get("gpu"), dict)
            and s["gpu"].get(key) is not None]


def _clock_events(r: dict) -> list[list]:
    return [e for e in _gpu(r, "clock_events") if isinstance(e, list)]


def _median(values) -> float | None:
    vals = [v for v in (num(x) for x in values) if v is not None]
    return float(statistics.median(vals)) if vals else None


def likely_cause(straggler: dict, peers: list[dict], tree) -> dict:
    """{"cause", "text", "evidence"} for a straggler (merged rank) against its peers, by the
    tree's straggler_cause_min_excess, throttle_sample_fraction, clock_deficit and busy_cpu."""
    th = tree.thresholds
    own = _parts_ms(straggler)
    others = [p for p in (_parts_ms(r) for r in peers) if p]
    ev: dict = {}
    if own is None or not others:
        return {"cause": "undetermined", "text": "too little was measured on this rank and its peers to tell why",
                "evidence": ev}
    peer = {k: statistics.median(p[k] for p in others) for k in own}
    excess = {k: own[k] - peer[k] for k in own}
    step = _step_ms(straggler) or 1.0
    ev.update({f"{k}_ms_per_step": round(own[k], 3) for k in own})
    ev.update({f"peers_{k}_ms_per_step": round(peer[k], 3) for k in peer})
    where = max(excess, key=lambda k: excess[k])
    if excess[where] < th["straggler_cause_min_excess"] * step:
        return {"cause": "undetermined", "evidence": ev,
                "text": "its data, host and device time per step are within noise of its peers'; look at "
                        "the collectives it reaches last"}
    more = f"{excess[where]:.1f} ms per step more than its peers"
    if where == "device":
        events = _clock_events(straggler)
        slowed = sum(1 for e in events if slowing_reasons(e))
        peer_events = [e for r in peers for e in _clock_events(r)]
        peer_slowed = sum(1 for e in peer_events if slowing_reasons(e))
        clock = _median(_gpu(straggler, "sm_clock_hz"))
        peer_clock = _median(c for r in peers for c in _gpu(r, "sm_clock_hz"))
        ev.update(slowdown_samples=slowed, samples_with_clock_events=len(events), sm_clock_hz=clock,
                  peers_sm_clock_hz=peer_clock, peers_slowdown_samples=peer_slowed,
                  peers_samples_with_clock_events=len(peer_events))
        share, peer_share = slowed / max(len(events), 1), peer_slowed / max(len(peer_events), 1)
        hotter = bool(events) and share >= th["throttle_sample_fraction"] and \
            share - peer_share >= th["throttle_sample_fraction"]
        slower_clock = bool(clock and peer_clock and clock <= (1 - th["clock_deficit"]) * peer_clock)
        if hotter or slower_clock:
            named = throttle_reasons if slower_clock else slowing_reasons  # a power cap counts with a low clock
            reasons = sorted({x for e in events for x in named(e)})
            marked = sum(1 for e in events if named(e))
            return {"cause": "throttling", "evidence": ev,
                    "text": f"a throttled device: its kernels take {more}"
                            + (f", with {', '.join(reasons)} in {marked} of {len(events)} samples" if reasons else "")
                            + (f" (its peers: {peer_share:.0%} of samples)" if hotter else "")
                            + (f", SM clock {clock / 1e6:.0f} MHz against {peer_clock / 1e6:.0f} MHz"
                               if clock and peer_clock else "")}
        return {"cause": "uneven_work", "evidence": ev,
                "text": f"uneven work: its device work takes {more} at normal clocks (larger batches or "
                        "sequences, or extra work such as evaluation or logging on this rank)"}
    if where == "data":
        return {"cause": "data_loader", "evidence": ev,
                "text": f"a slow input pipeline: it waits for the DataLoader {more}"}
    cpu = _median(s["host"].get("cpu_ratio") for s in straggler.get("samples") or []
                  if isinstance(s.get("host"), dict))
    ev["host_cpu_ratio"] = cpu
    if cpu is not None and cpu >= th["busy_cpu"]:
        return {"cause": "busy_cpu", "evidence": ev,
                "text": f"a busy CPU: its host time is {more} and its host's CPUs are {cpu:.0%} busy"}
    return {"cause": "host_work", "evidence": ev,
            "text": f"host-side work: the device idles {more} while the host runs Python, I/O, logging or "
                    "synchronisation outside the profiled kernels"}


def with_likely_causes(job: dict, ranks: dict, tree) -> dict:
    """A new job block: each named straggler with its likely cause, said in the straggler findings too."""
    names = {s["rank"] for s in job.get("stragglers") or [] if isinstance(s, dict) and s.get("rank") in ranks}
    if not names:
        return job
    peers = [r for k, r in ranks.items() if k not in names]
    stragglers = [{**s, "likely_cause": s.get("likely_cause") or likely_cause(ranks[s["rank"]], peers, tree)}
                  if isinstance(s, dict) and s.get("rank") in names else s for s in job["stragglers"]]
    first = next(s for s in stragglers if isinstance(s, dict) and s.get("rank") in names)
    cause = first["likely_cause"]
    findings = []
    for f in job.get("findings") or []:
        if isinstance(f, dict) and f.get("id") in ("straggler", "straggler_induced_comm") \
                and "likely_cause" not in (f.get("evidence") or {}):
            f = {**f, "message": f"{f['message'].rstrip('.')}. Likely cause on rank {first['rank']}: {cause['text']}.",
                 "evidence": {**(f.get("evidence") or {}), "likely_cause": cause["cause"]}}
        findings.append(f)
    return {**job, "stragglers": stragglers, "findings": findings}
