"""`diag nccl` against a bare torch.distributed timing loop, side by side on gloo.

Both measure all_reduce of float32 on the same sizes with the same process count:

- the baseline is an independent script written below (warm-up, barrier, a plain loop of
  dist.all_reduce timed with time.perf_counter, mean time over the ranks, busbw =
  size / time x 2(n-1)/n; two timed loops per size, the better kept, as diag times an
  out-of-place and an in-place loop), started with `python -m torch.distributed.run`;
- `diag nccl --nproc-per-node N -c 0` (results not checked, as the baseline does not check;
  both reduce buffers of zeros).

The two commands alternate for --rounds rounds and each keeps its best busbw per size.
On a busy machine whole runs differ by more than any timing overhead, so a second,
paired comparison runs both loops in one job, alternating at every size (medians of
--pairs alternations, the best of each kept). The timing loop of `diag nccl` should add no measurable
overhead: the ratios should stay within 10% of 1.

    python bench/bench_nccl_runner.py [--nproc 2] [-b 64K] [-e 4M] [-n 50] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

BASELINE = textwrap.dedent(
    """
    import json, os, sys, time
    import torch
    import torch.distributed as dist

    sizes = [int(s) for s in sys.argv[1].split(",")]
    warmup, iters, out = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dist.init_process_group("gloo")
    n, rank = dist.get_world_size(), dist.get_rank()
    result = {}
    for size in sizes:
        x = torch.zeros(size // 4, dtype=torch.float32)  # as diag's buffers with -c 0
        for _ in range(warmup):
            dist.all_reduce(x)
        best = 0.0
        for _ in range(2):  # as many timed loops per size as diag's two placements
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(x)
            sec = (time.perf_counter() - t0) / iters
            t = torch.tensor([sec], dtype=torch.float64)
            dist.all_reduce(t)
            sec = t.item() / n
            best = max(best, size / sec / 1e9 * 2 * (n - 1) / n)
        result[size] = best
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()
    """
)


# Paired: one job; at every size each rank alternates the bare loop and diag's own
# measurement (nccl_bench.run_rank, the code `diag nccl` runs in every rank), so both see
# the same machine at the same moment.
PAIRED = BASELINE.split("dist.init_process_group")[0] + textwrap.dedent(
    """
    import statistics
    from diag.collectors import nccl_bench as nb

    pairs = int(sys.argv[5])
    dist.init_process_group("gloo")
    n, rank = dist.get_world_size(), dist.get_rank()

    def bare(size):
        x = torch.zeros(size // 4, dtype=torch.float32)  # as diag's buffers with -c 0
        for _ in range(warmup):
            dist.all_reduce(x)
        best = 0.0
        for _ in range(2):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(x)
            t = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
            dist.all_reduce(t)
            best = max(best, size / (t.item() / n) / 1e9 * 2 * (n - 1) / n)
        return best

    def diag(size):
        cfg = nb.BenchConfig(min_bytes=size, max_bytes=size, step_factor=2, warmup_iters=warmup,
                             iters=iters, check=0, timeout=300)
        row = nb.run_rank(cfg)["tests"][0]["rows"][0]
        return max(row["out_of_place"]["busbw_gbps"], row["in_place"]["busbw_gbps"])

    result = {}
    for size in sizes:
        ratios, b_all, d_all = [], [], []
        for i in range(pairs):
            if i % 2 == 0:
                b, d = bare(size), diag(size)
            else:
                d, b = diag(size), bare(size)
            ratios.append(d / b)
            b_all.append(b)
            d_all.append(d)
        # Load from other processes only ever adds time: the best of each is the least disturbed.
        result[size] = [max(b_all), max(d_all), max(d_all) / max(b_all), statistics.median(ratios)]
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()
    """
)


def run_paired(script: Path, nproc: int, sizes: list[int], warmup: int, iters: int, pairs: int, tmp: Path) -> dict:
    out = tmp / "paired.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(script), ",".join(map(str, sizes)), str(warmup), str(iters), str(out), str(pairs)]
    subprocess.run(cmd, check=True, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=1800)
    return {int(k): v for k, v in json.loads(out.read_text()).items()}


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def run_baseline(script: Path, nproc: int, sizes: list[int], warmup: int, iters: int, tmp: Path) -> dict:
    out = tmp / "baseline.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(script), ",".join(map(str, sizes)), str(warmup), str(iters), str(out)]
    subprocess.run(cmd, check=True, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
    return {int(k): v for k, v in json.loads(out.read_text()).items()}


def run_diag(nproc: int, minb: str, maxb: str, warmup: int, iters: int, tmp: Path) -> dict:
    out = tmp / "diag.json"
    cmd = [sys.executable, "-m", "diag", "nccl", "--nproc-per-node", str(nproc), "-b", minb, "-e", maxb,
           "-f", "2", "-w", str(warmup), "-n", str(iters), "-c", "0", "--no-progress", "--json", str(out)]
    subprocess.run(cmd, check=True, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
    rows = json.loads(out.read_text())["tests"][0]["rows"]
    # Both columns time the same in-place call (torch's all_reduce has no out-of-place form).
    return {r["size_bytes"]: max(r["out_of_place"]["busbw_gbps"], r["in_place"]["busbw_gbps"]) for r in rows}


def main() -> int:
    from diag.collectors.nccl_bench import parse_size, sweep_sizes

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("-b", default="64K")
    ap.add_argument("-e", default="4M")
    ap.add_argument("-w", type=int, default=5)
    ap.add_argument("-n", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=6, help="alternations per size in the paired job")
    args = ap.parse_args()
    sizes = sweep_sizes(parse_size(args.b), parse_size(args.e), 2)
    best_base: dict[int, float] = {}
    best_diag: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        script = tmp / "baseline_allreduce.py"
        script.write_text(BASELINE)
        paired_script = tmp / "paired_allreduce.py"
        paired_script.write_text(PAIRED)
        paired = run_paired(paired_script, args.nproc, sizes, args.w, args.n, args.pairs, tmp)
        for i in range(args.rounds):
            base = run_baseline(script, args.nproc, sizes, args.w, args.n, tmp)
            diag = run_diag(args.nproc, args.b, args.e, args.w, args.n, tmp)
            for s in sizes:
                best_base[s] = max(best_base.get(s, 0.0), base[s])
                best_diag[s] = max(best_diag.get(s, 0.0), diag[s])
            print(f"round {i + 1}/{args.rounds} done", file=sys.stderr)
    print(f"all_reduce float32 on gloo, {args.nproc} processes, warm-up {args.w}, {args.n} iterations, "
          f"best of {args.rounds} alternating rounds")
    print(f"{'size (B)':>10}  {'bare loop busbw':>16}  {'diag nccl busbw':>16}  {'diag/bare':>9}")
    ratios = []
    for s in sizes:
        ratio = best_diag[s] / best_base[s] if best_base[s] else float("nan")
        ratios.append(ratio)
        print(f"{s:>10}  {best_base[s]:>12.4f} GB/s  {best_diag[s]:>12.4f} GB/s  {ratio:>9.3f}")
    geo = 1.0
    for r in ratios:
        geo *= r
    geo **= 1 / len(ratios)
    within = sum(1 for r in ratios if abs(r - 1) <= 0.10)
    print(f"whole commands: geometric mean ratio {geo:.3f}; {within}/{len(ratios)} sizes within 10%")
    print()
    print(f"paired in one job: bare loop and diag's measurement alternate {args.pairs} times per size "
          "(best of each; median of the per-pair ratios beside it)")
    print(f"{'size (B)':>10}  {'bare loop busbw':>16}  {'diag nccl busbw':>16}  {'diag/bare':>9}  {'median pair':>11}")
    pratios = []
    for s in sizes:
        b, d, r, med = paired[s]
        pratios.append(r)
        print(f"{s:>10}  {b:>12.4f} GB/s  {d:>12.4f} GB/s  {r:>9.3f}  {med:>11.3f}")
    geo = 1.0
    for r in pratios:
        geo *= r
    geo **= 1 / len(pratios)
    within = sum(1 for r in pratios if abs(r - 1) <= 0.10)
    print(f"paired: geometric mean ratio {geo:.3f}; {within}/{len(pratios)} sizes within 10%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
