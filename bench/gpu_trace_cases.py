"""Record small real GPU traces of known causes, for the cause rules' tests.

    python bench/gpu_trace_cases.py --out DIR [--case NAME ...]

Run it on a node with a CUDA or ROCm GPU. Each case is a short training-like loop with one
cause induced on purpose (or none, for the healthy cases), profiled by torch.profiler for
three steps after two of warm-up, with input shapes recorded. Each trace is written as
DIR/<case>.json.gz, and DIR/cases.json says what each case induces, the device, torch's
version and the steps' mean wall time outside the profiler; where the case has a fixed
variant (the cause removed as diag's action says), that variant's wall time too, to check
the predicted gain against, and its trace as DIR/<case>.fixed.json.gz: the profiler slows
host work made of many short events more than a few long ops, so a prediction made in the
traced step's units is best checked against the fixed loop traced the same way.

Traces from this script, trimmed, are committed under tests/fixtures/real/ with the node
they came from in SOURCE.md.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

DEV = torch.device("cuda")


def _mlp(width: int, dtype=torch.float32) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, width)).to(DEV, dtype)


def _train_step(model, opt, x):
    loss = model(x).float().square().mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss


def case_cpu_ops_on_thread(fixed: bool = False):
    """CPU-side augmentation with torch ops on the training thread while the GPU waits."""
    model = _mlp(1024)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    where = DEV if fixed else "cpu"
    mean, std = torch.rand(1, 3, 1, 1, device=where), torch.rand(1, 3, 1, 1, device=where) + 0.5

    def step():
        img = torch.rand(64, 3, 160, 160, device=where)
        img = torch.flip(img, [3])
        img = (img - mean) / std
        img = torch.nn.functional.interpolate(img, size=(128, 128), mode="bilinear", align_corners=False)
        x = img.flatten(1)[:, :1024].contiguous().to(DEV)
        _train_step(model, opt, x)
    return step


def case_elementwise_bandwidth():
    """Large elementwise ops, each a full pass over memory: bandwidth-bound kernels near peak."""
    w = torch.nn.Parameter(torch.randn(64 * 2**20, device=DEV))
    opt = torch.optim.SGD([w], lr=1e-3, foreach=True)

    def step():
        y = w * 1.5
        y = y + 0.25
        y = torch.relu(y)
        y = y * w
        loss = y.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def case_strided_gather():
    """Transposed copies and a random gather: bandwidth-bound kernels far below peak."""
    a = torch.randn(8192, 8192, device=DEV)
    idx = torch.randint(0, a.numel(), (16 * 2**20,), device=DEV)

    def step():
        t = a.t().contiguous()
        g = a.view(-1)[idx]
        s = a[:, ::7].contiguous()
        return t.sum() + g.sum() + s.sum()
    return step


def case_empty_cache(fixed: bool = False):
    """torch.cuda.empty_cache() in the loop: the allocator frees and reallocates every step."""
    model = _mlp(2048)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        x = torch.randn(512, 2048, device=DEV)
        _train_step(model, opt, x)
        if not fixed:
            torch.cuda.empty_cache()
    return step


def case_item_sync(fixed: bool = False):
    """A Python loop over .item(): the host blocks on the device once per element."""
    model = _mlp(1024)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        x = torch.randn(256, 1024, device=DEV)
        out = model(x)
        scores = out[:, 0]
        kept = scores[:32].sum() if fixed else sum(float(scores[i].item()) for i in range(32))
        loss = out.square().mean() + 0.0 * kept
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def case_launch_bound():
    """Hundreds of tiny kernels per step: the host's launches set the pace."""
    params = [torch.nn.Parameter(torch.randn(256, device=DEV)) for _ in range(64)]
    opt = torch.optim.SGD(params, lr=1e-3, foreach=False)

    def step():
        loss = 0
        for p in params:
            loss = loss + (p * 2 + 1).relu().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def case_pageable_copy(fixed: bool = False):
    """A 64 MiB batch copied from pageable host memory every step."""
    model = _mlp(4096)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    host = torch.randn(4096, 4096).pin_memory() if fixed else torch.randn(4096, 4096)

    def step():
        x = host.to(DEV, non_blocking=fixed)
        _train_step(model, opt, x[:512])
    return step


def case_matmul_fp32_odd(fixed: bool = False):
    """fp32 matmuls without TF32, with shapes the tensor-core tile does not divide."""
    model = _mlp(4095)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4097, 4095, device=DEV)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=fixed):
            _train_step(model, opt, x)
    return step


def case_matmul_bf16():
    """Healthy: large bf16 matmuls on tile-sized shapes keep the tensor cores busy."""
    model = _mlp(8192, torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, fused=True)
    x = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)

    def step():
        _train_step(model, opt, x)
    return step


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}
# The cases with a fixed variant (`fixed=True`: the cause removed as diag's action says).
FIXED = {
    "cpu_ops_on_thread": "The same augmentation on the device.",
    "empty_cache": "No empty_cache() in the loop.",
    "item_sync": "The 32 values reduced on the device; nothing read back.",
    "pageable_copy": "The batch in pinned memory, copied with non_blocking=True.",
    "matmul_fp32_odd": "The same products under bf16 autocast.",
}


def _wall_ms(step, n: int = 20, warmup: int = 3) -> float:
    """Mean wall time of a step, after `warmup` steps, outside any profiler."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def _trace(step, path: Path) -> float:
    """Profile `step` for three steps after two of warm-up, as the slow loop is, into `path`
    (gzipped); the median traced step (ms) from the profiler's own step markers."""
    raw = path.with_suffix("")
    sched = torch.profiler.schedule(wait=0, warmup=2, active=3, repeat=1)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, schedule=sched, record_shapes=True,
                                on_trace_ready=lambda p: p.export_chrome_trace(str(raw))) as prof:
        for _ in range(5):
            step()
            prof.step()
    torch.cuda.synchronize()
    events = json.loads(raw.read_text()).get("traceEvents") or []
    steps = [e["dur"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")
             and e.get("cat") == "user_annotation" and isinstance(e.get("dur"), (int, float))]
    with open(raw, "rb") as src, gzip.open(path, "wb", compresslevel=9) as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    return statistics.median(steps) / 1e3 if steps else float("nan")


def record(name: str, out: Path) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    step = CASES[name]()
    wall = _wall_ms(step)
    fixed_step = CASES[name](fixed=True) if name in FIXED else None
    fixed = _wall_ms(fixed_step) if fixed_step else None
    traced = _trace(step, out / f"{name}.json.gz")
    fixed_traced = _trace(fixed_step, out / f"{name}.fixed.json.gz") if fixed_step else None
    del step, fixed_step
    torch.cuda.empty_cache()
    return {"case": name, "induces": CASES[name].__doc__.strip(), "wall_step_ms": round(wall, 3),
            "traced_step_ms": round(traced, 3), "fixed": FIXED.get(name),
            "fixed_wall_step_ms": round(fixed, 3) if fixed is not None else None,
            "fixed_traced_step_ms": round(fixed_traced, 3) if fixed_traced is not None else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--case", action="append", choices=sorted(CASES))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_trace_cases: no CUDA or ROCm device visible to torch; nothing to record")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.case or sorted(CASES):
        try:
            rows.append(record(name, out))
        except Exception as exc:  # one broken case must not lose the others' traces
            rows.append({"case": name, "error": f"{type(exc).__name__}: {exc}"[:200]})
        print(json.dumps(rows[-1]), flush=True)
    props = torch.cuda.get_device_properties(0)
    meta = {"device": props.name, "torch": torch.__version__, "cuda": torch.version.cuda,
            "hip": torch.version.hip, "host": os.uname().nodename, "cases": rows}
    (out / "cases.json").write_text(json.dumps(meta, indent=1))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
