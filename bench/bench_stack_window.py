"""What recording Python stacks costs a profiler window: the agent's first window records them.

    python bench/bench_stack_window.py [--windows 6] [--steps 4]

A CPU training loop (an MLP of 4 layers, a loss and an optimizer step, and a Python helper
per step, as a training loop has) is recorded in alternating windows with and without
`with_stack`, the same way the agent records a window (one torch.profiler per window). For
each kind it prints the median step time inside the window against the median of the steps
between windows, the time `stop_trace` takes on the training thread, and the trace's size.
The agent's default (`stack_windows = 1`) pays the stack column once per run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--windows", type=int, default=6, help="windows of each kind")
    p.add_argument("--steps", type=int, default=4, help="recorded steps per window")
    a = p.parse_args()

    import torch
    from torch import nn
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(512, 512), nn.ReLU())])
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(64, 512)

    def log_loss(loss):  # a Python helper as training loops have
        return float(loss.detach())

    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        log_loss(loss)

    def timed(n):
        out = []
        for _ in range(n):
            t = time.perf_counter()
            step()
            out.append(time.perf_counter() - t)
        return out

    timed(20)  # warm-up
    rows = {True: {"inside": [], "between": [], "stop": [], "mb": []},
            False: {"inside": [], "between": [], "stop": [], "mb": []}}
    with tempfile.TemporaryDirectory(prefix="diag-stack-") as tmp:
        for w in range(2 * a.windows):
            stack = w % 2 == 0
            r = rows[stack]
            r["between"] += timed(a.steps * 2)
            prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True, with_stack=stack)
            prof.start()
            r["inside"] += timed(a.steps)
            t = time.perf_counter()
            prof.stop()
            r["stop"].append(time.perf_counter() - t)
            path = os.path.join(tmp, f"w{w}.json")
            prof.export_chrome_trace(path)
            r["mb"].append(os.path.getsize(path) / 1e6)
    print(f"{'window':>14} {'step in window':>15} {'step between':>13} {'ratio':>6} {'stop_trace':>11} {'trace MB':>9}")
    for stack in (False, True):
        r = rows[stack]
        inside, between = statistics.median(r["inside"]), statistics.median(r["between"])
        print(f"{'with stacks' if stack else 'without':>14} {1e3 * inside:>12.2f} ms {1e3 * between:>10.2f} ms "
              f"{inside / between:>6.2f} {1e3 * statistics.median(r['stop']):>8.1f} ms {statistics.median(r['mb']):>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
