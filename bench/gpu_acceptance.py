"""GPU acceptance run: what diag should see on a real CUDA or ROCm node, expected against got.

    python bench/gpu_acceptance.py [--steps 60] [--keep DIR]

Run it on a node with at least one GPU (torch with CUDA or ROCm). Each part runs in its own
process, so a crash is a failed row and not the end of the run:

1. a CUDA training loop under diag.Agent whose DataLoader sleeps per batch (data-bound),
   with a profiler window: device step time recorded, NVML/amdsmi samples, a window trace
   with kernels, and the verdict;
2. the same loop with fast data and a large matmul per step: compute-bound;
3. the loop with the job's own torch.profiler starting inside diag's window: the job's
   trace keeps its steps and training finishes;
4. `diag nccl` (all_reduce, 8 B to 64 MB) on every visible GPU: status and bus bandwidth;
5. `diag demo --steps 16`: exit status and verdict.

Prints one table (check, expected, got, ok) and exits 1 if a row failed. On a machine
without a GPU it prints one line saying so and exits 0.
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

LOOP = textwrap.dedent("""
    import glob, json, sys, time, torch, diag
    mode, run, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dev = torch.device("cuda")
    # Compute-bound on any data-centre GPU: 6.6 TFLOP of fp32 matmuls per step (about 0.1 s on
    # an H100), batches made on the device. A 64-row batch of 4096-wide layers is not: an H200
    # runs it in under a millisecond, and the host's batch making and launches set the pace.
    width, rows = (8192, 4096) if mode == "compute" else (512, 64)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)]).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def batches():
        for _ in range(steps):
            if mode == "data":
                time.sleep(0.05)  # a slow input pipeline: the device idles while the host waits
            yield torch.randn(rows, width, device=dev if mode == "compute" else "cpu")

    user = []
    with diag.Agent(run_dir=run, export=False, skip_first=5, warmup=1, active=3, every=20, report=True,
                    verbose=False) as agent:
        prof = None
        for i, x in enumerate(agent.loader(batches())):
            if mode == "user_profiler" and i == 26:  # inside diag's window at 26-28
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                          torch.profiler.ProfilerActivity.CUDA])
                prof.start()
            with torch.autograd.profiler.record_function(f"user_step_{i}"):
                loss = model(x.to(dev, non_blocking=True)).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            if prof is not None and i == 32:
                prof.stop()
                prof.export_chrome_trace(run + "/user_trace.json")
                user = sorted({e["name"] for e in json.load(open(run + "/user_trace.json"))["traceEvents"]
                               if str(e.get("name", "")).startswith("user_step_")})
                prof = None
            agent.step(samples=64)
    recs = [json.loads(line) for p in sorted(glob.glob(run + "/rank-*/steps/*.jsonl")) for line in open(p)]
    samples = [json.loads(line) for p in sorted(glob.glob(run + "/rank-*/samples/*.jsonl")) for line in open(p)]
    summary = json.load(open(glob.glob(run + "/**/summary.json", recursive=True)[0]))
    sampled = (json.load(open(glob.glob(run + "/rank-*/rank.json")[0])).get("device") or {}).get("uuid")
    print(json.dumps({
        "sampled_uuid": sampled,
        "torch_uuid": str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid),
        "verdict": (summary.get("diagnosis") or {}).get("bound"),
        "device_steps": sum(1 for r in recs if r.get("device_s")),
        "steps": len(recs),
        "gpu_samples": sum(1 for s in samples if isinstance(s.get("gpu"), dict)
                           and s["gpu"].get("utilization_ratio") is not None),
        "windows": len(glob.glob(run + "/rank-*/traces/window-*")),
        "user_steps": user,
    }))
""")


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def _run(cmd: list[str], timeout: float) -> tuple[int, str, str]:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired:
        return -1, "", f"no result within {timeout:.0f} s"


def _loop(mode: str, root: Path, steps: int) -> dict:
    script = root / "loop.py"
    script.write_text(LOOP)
    rc, out, err = _run([sys.executable, str(script), mode, str(root / f"run-{mode}"), str(steps)], 900)
    if rc != 0:
        return {"error": (err.strip().splitlines() or [f"exit {rc}"])[-1][:120]}
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--keep", help="keep the run directories here")
    args = ap.parse_args(argv)
    gpus = _gpu_count()
    if gpus == 0:
        print("gpu_acceptance: no CUDA or ROCm device visible to torch; nothing to check on this machine")
        return 0
    root = Path(args.keep or tempfile.mkdtemp(prefix="diag-gpu-acceptance-"))
    root.mkdir(parents=True, exist_ok=True)
    rows: list[tuple[str, str, str, bool]] = []

    def row(check, expected, got, ok):
        rows.append((check, expected, str(got), bool(ok)))

    for mode, verdict in (("data", "data"), ("compute", "compute")):
        r = _loop(mode, root, args.steps)
        if "error" in r:
            row(f"{mode} loop", "runs", r["error"], False)
            continue
        row(f"{mode} loop: verdict", verdict, r["verdict"], r["verdict"] == verdict)
        row(f"{mode} loop: steps with device time", f">= {r['steps'] - 2} of {r['steps']}", r["device_steps"],
            r["device_steps"] >= r["steps"] - 2)
        row(f"{mode} loop: GPU samples with utilisation", ">= 1", r["gpu_samples"], r["gpu_samples"] >= 1)
        row(f"{mode} loop: profiler windows", ">= 2", r["windows"], r["windows"] >= 2)
        same = bool(r["sampled_uuid"]) and r["torch_uuid"].lower() in r["sampled_uuid"].lower()
        row(f"{mode} loop: sampled device is torch's", r["torch_uuid"][:13], r["sampled_uuid"], same)
    r = _loop("user_profiler", root, args.steps)
    if "error" in r:
        row("job's own profiler", "training finishes", r["error"], False)
    else:
        want = sorted(f"user_step_{i}" for i in range(26, 33))
        row("job's own profiler: its trace keeps its steps", "user_step_26..32", f"{len(r['user_steps'])} steps",
            r["user_steps"] == want)
    rc, out, err = _run([sys.executable, "-m", "diag", "nccl", "-b", "8", "-e", "64M", "-f", "4",
                         "--nproc-per-node", str(gpus), "--json", str(root / "nccl.json")], 900)
    # One rank moves nothing between GPUs: its bus bandwidth is 0 by definition, as in nccl-tests,
    # and the algorithm bandwidth (bytes over time) is what shows the run worked.
    figure = "algbw_gbps" if gpus == 1 else "busbw_gbps"
    try:
        tests = json.loads((root / "nccl.json").read_text())["tests"]
        best = {t["collective"]: max((r["out_of_place"][figure] for r in t.get("rows") or []), default=0.0)
                for t in tests}
        ok = rc == 0 and tests and all(t["status"] == "ok" and best[t["collective"]] > 0 for t in tests)
        got = ", ".join(f"{t['collective']} {t['status']} {best[t['collective']]:.1f} GB/s" for t in tests)
    except (OSError, ValueError, KeyError, TypeError):
        ok, got = False, (err.strip().splitlines() or [f"exit {rc}"])[-1][:120]
    row(f"diag nccl on {gpus} GPU(s)", f"status ok, {figure.split('_')[0]} > 0", got, ok)
    rc, out, err = _run([sys.executable, "-m", "diag", "demo", "--steps", "16", "--no-export", "--run-dir",
                         str(root / "demo")], 900)
    row("diag demo", "exit 0", rc, rc == 0)

    width = [max(len(r[i]) for r in rows + [("check", "expected", "got", True)]) for i in range(3)]
    print(f"{'check':<{width[0]}}  {'expected':<{width[1]}}  {'got':<{width[2]}}  ok")
    for check, expected, got, ok in rows:
        print(f"{check:<{width[0]}}  {expected:<{width[1]}}  {got:<{width[2]}}  {'yes' if ok else 'NO'}")
    print(f"runs kept in {root}" if args.keep else f"runs in {root}")
    return 0 if all(r[3] for r in rows) else 1


if __name__ == "__main__":
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        print("gpu_acceptance: CUDA_VISIBLE_DEVICES is empty; nothing to check on this machine")
        sys.exit(0)
    sys.exit(main())
