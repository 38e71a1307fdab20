"""The job merge at 1,024 and 8,192 ranks: time and peak memory, and the stragglers found.

    python bench/bench_merge.py [--ranks 1024 8192] [--stragglers 3] [--delay 0.25] [--seed 0]

The per-rank summaries are what `diag analyze --ray` gets back from its tasks. They are
generated from a real one: rank 0 of a 2-rank A100 data-parallel job
(shared data `traces/a100_2rank_nccl.json.gz`: 3 steps, 21 NCCL all-reduces), analysed
by diag. Each simulated rank gets:
- a clock offset of up to a second (ranks' clocks disagree);
- arrival jitter at each collective, 0-2% of a step;
- step times with 1% noise.
A few ranks, drawn at random, are stragglers: they reach every collective `--delay` of a
step late. Each collective ends when its last rank arrives plus its own transfer time, so
the others' records show the wait. The merge is then timed:
- waits split (`split_waits`), cross-rank matching (`job_facts`), then verdicts given and peers
  resolved (`judged_ranks`) and stragglers judged (`with_diagnosis`);
- the diagnosis (`with_diagnosis`).
It is timed once plainly, and once under tracemalloc for the peak memory it allocates. The
check is that exactly the injected stragglers are named.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import random
import sys
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def template_facts(path):
    """The facts of one real trace, which every simulated rank starts from."""
    from diag.analyzers.diagnosis import decision_tree as dt
    from diag.analyzers.trace.analysis import trace_facts

    return trace_facts(path, dt.load_tree().facts)


def _template():
    data = Path(os.environ.get("DIAG_REAL_DATA") or REPO.parent / "shared" / "data")
    real = data / "traces" / "a100_2rank_nccl.json.gz"
    if real.is_file():
        return template_facts(real), str(real)
    cpu = REPO / "tests" / "fixtures" / "cpu_comm_rank0.pt.trace.json.gz"
    return template_facts(cpu), f"{cpu} (real data not found: set DIAG_REAL_DATA)"


def simulate(template, n: int, stragglers: set[int], delay: float, rng: random.Random) -> list:
    """n per-rank facts from one real rank's (a TraceRankFacts), with waits that follow from
    arrival times."""
    import msgspec

    colls = sorted(template.causes.collectives, key=lambda c: c["ts_us"])
    steps = template.steps
    step_us = 1000.0 * sorted(s["duration_ms"] for s in steps)[len(steps) // 2]
    offsets = [rng.uniform(0, 1e6) for _ in range(n)]
    ranks = []
    for r in range(n):
        ranks.append(msgspec.structs.replace(
            template, rank=r, world_size=n, source=f"rank-{r}",
            steps=[dict(s, duration_ms=s["duration_ms"] * rng.uniform(0.99, 1.01)) for s in steps],
            causes=msgspec.structs.replace(template.causes, collectives=[])))
    for c in colls:
        transfer = c["dur_us"]
        arrive = [rng.uniform(0, 0.02 * step_us) + (delay * step_us if r in stragglers else 0.0) for r in range(n)]
        end = max(arrive) + transfer
        for r in range(n):
            ts = c["ts_us"] + arrive[r] + offsets[r]
            dur = end - arrive[r]
            ranks[r].causes.collectives.append(dict(c, ts_us=ts, dur_us=dur, exposed=[[ts, ts + dur]]))
    return ranks


def merge(ranks: list):
    from diag.analyzers.analysis_types import AnalysisFacts
    from diag.analyzers.analyze import job_facts, judged_ranks, split_waits, with_diagnosis
    from diag.analyzers.diagnosis import decision_tree as dt

    tree = dt.load_tree()
    ranks = split_waits(ranks)
    facts = AnalysisFacts(ranks=ranks, job=job_facts(ranks, tree))
    return with_diagnosis(facts, judged_ranks(ranks, tree), tree)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--stragglers", type=int, default=3)
    ap.add_argument("--delay", type=float, default=0.25, help="how late a straggler is, as a share of a step")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    template, source = _template()
    print(f"template: {source}: {len(template.causes.collectives)} collectives, {len(template.steps)} steps")
    ok = True
    for n in args.ranks:
        rng = random.Random(args.seed + n)
        injected = set(rng.sample(range(n), args.stragglers))
        ranks = simulate(template, n, injected, args.delay, rng)
        kept = copy.deepcopy(ranks)  # the merge adds to the rank dicts: the memory pass gets fresh ones
        gc.collect()
        t0 = time.perf_counter()
        doc = merge(ranks)
        wall = time.perf_counter() - t0
        del doc, ranks
        gc.collect()
        tracemalloc.start()
        doc = merge(kept)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        found = {s["rank"] for s in doc.job.stragglers}
        hit = found == injected
        ok &= hit
        per_rank = sum(len(r.causes.collectives) for r in kept) / n
        print(f"{n:6d} ranks x {per_rank:.0f} collectives: merge {wall:6.2f} s "
              f"({wall / n * 1e3:.2f} ms per rank), peak {peak / 2**20:7.1f} MiB allocated; "
              f"stragglers injected {sorted(injected)}, found {sorted(found)}: {'ok' if hit else 'MISSED'}")
        print(f"        verdict: {doc.diagnosis.headline['text'][:160]}")
        del doc, kept
        gc.collect()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
