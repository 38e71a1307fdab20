"""Why a straggler is late: its own time against its peers', and its device and host readings.

The cross-rank analysis names the rank the others wait for; this says what to look at on
it. Each step the straggler spends longer than its peers somewhere, and where decides:
- device work (compute and bandwidth-bound kernels) longer than the peers': more samples,
  tokens or op calls per step than the peers' is uneven work; a throttled device when its SM
  clock reads lower than its peers' (a power cap among them), or when it reports thermal or
  hardware slowdown in more of its samples than its peers do; on a rank that computes on the
  CPU, the same work taking longer is CPU contention (its process gets less CPU time); else
  uneven work (longer sequences, extra layers or evaluation on this rank). A power cap that
  every board reports under load is no cause by itself;
- waiting for the DataLoader longer: a slow input pipeline on this rank;
- host time longer (device idle, not waiting for data): a busy CPU when the host reads
  nearly saturated, else work outside the profiled steps (Python, I/O, logging).
Differences under `straggler_cause_min_excess` of a step are noise, and then the cause is left open.

Pure: reads the merged ranks of `inputs.merge_ranks`, returns plain data.
"""

from __future__ import annotations

import statistics

import msgspec

from diag.analyzers.analysis_types import Job
from diag.analyzers.diagnosis.inputs import MergedRank, Ranks, num, rank_shares, traced_steps
from diag.analyzers.diagnosis.throttle import slowing_reasons, throttle_reasons
from diag.analyzers.numbers import dict_at
from diag.analyzers.numbers import median as _median


def _step_ms(r: MergedRank) -> float | None:
    d = r.step_table.dur
    d = d[d == d]
    return float(statistics.median(d.tolist())) * 1000 if len(d) else None


def _parts_ms(r: MergedRank) -> dict | None:
    """Milliseconds per median step in data, host and device work."""
    sh, ms = rank_shares(r), _step_ms(r)
    if not sh or ms is None:
        return None
    return {"data": sh["data"] * ms, "host": sh["host"] * ms, "device": (sh["compute"] + sh["memory"]) * ms}


def _gpu(r: MergedRank, key: str) -> list:
    return [s["gpu"].get(key) for s in r.samples if isinstance(s.get("gpu"), dict)
            and s["gpu"].get(key) is not None]


def _clock_events(r: MergedRank) -> list[list]:
    return [e for e in _gpu(r, "clock_events") if isinstance(e, list)]


def excess_at(excess: dict[str, float | None], step_ms: float, thresholds) -> str | None:
    """Where a straggler's excess over its peers lies: the part of its step ("data", "host",
    "device"; None where not measured) with the largest excess, when that reaches
    `straggler_cause_min_excess` of a step; None when no part does (noise). The one rule for
    the report's likely cause and `diag top`'s (diagnosis/live.py), each on what it measured."""
    known = {k: v for k, v in excess.items() if v is not None}
    if not known:
        return None
    where = max(known, key=lambda k: known[k])
    return where if known[where] >= thresholds["straggler_cause_min_excess"] * step_ms else None


def likely_cause(straggler: MergedRank, peers: list[MergedRank], tree) -> dict:
    """{"cause", "text", "evidence"} for a straggler (merged rank) against its peers, by the
    tree's straggler_cause_min_excess, straggler_same_work_tolerance, straggler_extra_work_share,
    throttle_sample_fraction, clock_deficit and busy_cpu."""
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
    where = excess_at(excess, step, th)
    if where is None:
        return {"cause": "undetermined", "evidence": ev,
                "text": "its data, host and device time per step are within noise of its peers'; look at "
                        "the collectives it reaches last"}
    more = f"{excess[where]:.1f} ms per step more than its peers"
    if where == "device":
        work = _work_difference(straggler, peers, th["straggler_same_work_tolerance"])
        ev.update(work["evidence"])
        # More op calls count only where their time at the peers' speed explains the lateness:
        # a rank whose ops all run slower is late for its speed, not for a few more calls.
        explains = work["more_data"] or work["extra_op_ms"] >= th["straggler_extra_work_share"] * excess[where]
        if work["more"] and explains:
            return {"cause": "uneven_work", "evidence": ev,
                    "text": f"uneven work: its device work takes {more}, and it {work['more']}"}
        if straggler.device == "CPU" and work["known"]:
            return {"cause": "cpu_contention", "evidence": ev, "text": _contention_text(straggler, more, work)}
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
    cpu = _median(s["host"].get("cpu_ratio") for s in straggler.samples
                  if isinstance(s.get("host"), dict))
    ev["host_cpu_ratio"] = cpu
    if cpu is not None and cpu >= th["busy_cpu"]:
        return {"cause": "busy_cpu", "evidence": ev,
                "text": f"a busy CPU: its host time is {more} and its host's CPUs are {cpu:.0%} busy"}
    return {"cause": "host_work", "evidence": ev,
            "text": f"host-side work: the device idles {more} while the host runs Python, I/O, logging or "
                    "synchronisation outside the profiled kernels"}


def _per_step(r: MergedRank) -> dict:
    """The work a rank did per step: samples and tokens (median of its step records), and the
    calls and milliseconds of its compute and memory ops per traced step (from its top ops)."""
    t = r.step_table
    out: dict = {}
    for key in ("samples", "tokens"):
        vals = getattr(t, key)
        vals = vals[vals == vals]
        out[key] = float(statistics.median(vals.tolist())) if len(vals) else None
    traced = traced_steps(r.facts)
    ops = {}
    for o in r.facts.top_ops if traced else []:
        calls, ms = (num(o.get("count")), num(o.get("time_ms"))) if isinstance(o, dict) else (None, None)
        if o.get("class") in ("compute", "memory") and isinstance(o.get("name"), str) and calls and ms is not None:
            ops[o["name"]] = (calls / traced, ms / traced)
    out["ops"] = ops
    return out


def _work_difference(straggler: MergedRank, peers: list[MergedRank], tol: float) -> dict:
    """{"more": what the straggler does more of per step (text) or None, "known": whether any
    measure is known on both sides, "more_data": whether it processes more samples or tokens,
    "extra_op_ms": its op work beyond its peers' at their speed, ms per step, "evidence"}; each
    measure agrees within `tol` or counts as more.

    Op work is the straggler's calls of the ops both sides ran, each at its peers' time per
    call, against the peers' own time in them: extra calls of a cheap op weigh little, and a
    rank whose ops merely run slower does the same work."""
    own, others = _per_step(straggler), [_per_step(p) for p in peers]
    ev, more, known, extra_op_ms, more_data = {}, [], 0, 0.0, False
    for key in ("samples", "tokens"):
        peer = _median(o[key] for o in others)
        if own[key] is None or not peer:
            continue
        known += 1
        ev[f"{key}_per_step"], ev[f"peers_{key}_per_step"] = own[key], peer
        if own[key] > (1 + tol) * peer:
            more_data = True
            more.append(f"processes {own[key]:g} {key} per step against its peers' {peer:g}")
    shared = set(own["ops"]).intersection(*(o["ops"] for o in others)) if others else set()
    peer_ops = {k: (statistics.median(o["ops"][k][0] for o in others),
                    statistics.median(o["ops"][k][1] for o in others)) for k in shared}
    peer_ms = sum(ms for _, ms in peer_ops.values())
    if peer_ms > 0:
        known += 1
        at_peer_speed = sum(own["ops"][k][0] * ms / calls for k, (calls, ms) in peer_ops.items())
        ev.update(op_calls_per_step=round(sum(own["ops"][k][0] for k in shared), 2),
                  peers_op_calls_per_step=round(sum(calls for calls, _ in peer_ops.values()), 2),
                  op_work_at_peers_speed_ms_per_step=round(at_peer_speed, 3),
                  peers_op_ms_per_step=round(peer_ms, 3))
        extra_op_ms = at_peer_speed - peer_ms
        if at_peer_speed > (1 + tol) * peer_ms:
            name = max(shared, key=lambda k: (own["ops"][k][0] - peer_ops[k][0]) * peer_ops[k][1] / peer_ops[k][0])
            more.append(f"runs more op calls per step ({name} {own['ops'][name][0]:g} against {peer_ops[name][0]:g}): "
                        f"{ev['op_work_at_peers_speed_ms_per_step']:.1f} ms of work at its peers' speed against "
                        f"their {ev['peers_op_ms_per_step']:.1f} ms")
    return {"more": " and ".join(more) or None, "known": known > 0, "more_data": more_data,
            "extra_op_ms": extra_op_ms, "evidence": ev}


def _contention_text(straggler: MergedRank, more: str, work: dict) -> str:
    ev = work["evidence"]
    same = []
    if "op_work_at_peers_speed_ms_per_step" in ev:
        same.append(f"its ops would take {ev['op_work_at_peers_speed_ms_per_step']:.1f} ms per step at their speed, "
                    f"against their {ev['peers_op_ms_per_step']:.1f} ms")
    same += [f"{ev[f'{k}_per_step']:g} {k} per step" for k in ("samples", "tokens") if f"{k}_per_step" in ev]
    cpu = dict_at(straggler.info, "cpu")
    ranks, cpus, threads = (num(straggler.info.get("local_world_size")), num(cpu.get("cpus")),
                            num(cpu.get("torch_threads")))
    load = (f" ({ranks:g} ranks × {threads:g} torch threads on {cpus:g} CPUs here)"
            if ranks and cpus and threads else "")
    return (f"CPU contention: the same work as its peers' ({'; '.join(same)}) takes {more}, so its process "
            f"gets less CPU time than theirs, from other processes on its host or more busy threads than "
            f"CPUs{load}")


def with_likely_causes(job: Job, ranks: Ranks, tree) -> Job:
    """A new job block: each named straggler with its likely cause, said in the straggler findings too."""
    names = {s["rank"] for s in job.stragglers if isinstance(s, dict) and s.get("rank") in ranks}
    if not names:
        return job
    peers = [r for k, r in ranks.items() if k not in names]
    stragglers = [{**s, "likely_cause": s.get("likely_cause") or likely_cause(ranks[s["rank"]], peers, tree)}
                  if isinstance(s, dict) and s.get("rank") in names else s for s in job.stragglers]
    first = next(s for s in stragglers if isinstance(s, dict) and s.get("rank") in names)
    cause = first["likely_cause"]
    findings = []
    for f in job.findings:
        if isinstance(f, dict) and f.get("id") in ("straggler", "straggler_induced_comm") \
                and "likely_cause" not in (f.get("evidence") or {}):
            f = {**f, "message": f"{f['message'].rstrip('.')}. Likely cause on rank {first['rank']}: {cause['text']}.",
                 "evidence": {**(f.get("evidence") or {}), "likely_cause": cause["cause"]}}
        findings.append(f)
    return msgspec.structs.replace(job, stragglers=stragglers, findings=findings)
