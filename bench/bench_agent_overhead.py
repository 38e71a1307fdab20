"""Overhead of diag.Agent on a CPU training loop (steps of ~20-50 ms), with and without it, interleaved.

    python bench/bench_agent_overhead.py [--blocks 8] [--block-steps 60] [--windows 3] [--export both]
                                         [--top none|run-dir|endpoints]

Machines running other work drift by tens of percent within seconds, so the comparison
is made in short alternating blocks: a block of steps without the agent, then a block
with a fresh agent, and so on. Each step's time is measured by this script's own clock.

1. Always-on mode (step timing, loader() data wait, sampling at 1 Hz, the Prometheus
   exporter, live verdicts; no profiler windows): the median step time with the agent
   over the median without it (target <= 1.005). The same ratio of the training
   thread's CPU time per step is printed too; it is insensitive to other processes.
2. The default profiler schedule (skip 10 steps, then 1 warm-up + 3 active steps every
   1000): a profiler window costs the slower profiled steps, stopping the profiler and
   exporting the trace, and the analysis process competing for the CPU. Runs of the
   default schedule are timed through two windows, each from its warm-up step until its
   analysis has finished; its excess over the same run's neighbouring steps, spread over
   the steps of the schedule's period (`every`) and multiplied by the always-on ratio, gives
   the whole-run ratio against the loop without the agent (target <= 1.02).
   The first window of a run also starts the analysis process (once per run); the
   second shows the steady state.
   The stall a window leaves is printed per window: the step that stops the profiler (torch
   collects the window's events on the training thread) and the slowest step after it, while
   the trace is written and analysed, each against the median step. `--export both` (the
   default) alternates runs with diag's default (a forked child writes a trace when that
   stalls training less) and runs whose traces are always written by a thread, which holds
   the GIL while torch writes the file.
   The step path's own cost is also timed directly (loader() + step() with no work),
   which no load from other processes can blur.
   With `--top run-dir` or `--top endpoints`, a `diag top` process watches the always-on
   blocks the whole time, refreshing every second from the run directory's live.json files
   or by scraping the rank's metrics endpoint (each block's agent reuses one run directory
   and one port, so the one `diag top` follows them all), and the ratio is taken with it. What
   `diag top` adds inside the training process is timed directly as well: the agent's live.json
   write and an endpoint's /metrics render, each once per second at `diag top`'s refresh.
3. The sampling thread's CPU time (and the agent's own background thread's) as a share
   of one core, at the default 1 Hz (target <= 1%).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time


def make_loop(width: int, batch: int):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    data = [torch.randn(batch, width) for _ in range(8)]

    def batches(n):
        for i in range(n):
            yield data[i % len(data)]

    def train_step(x):
        loss = model(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return batches, train_step


def timed_steps(it, train_step, agent=None, until=None):
    """Per-step (wall, training-thread CPU) times; `until(i)` may end the loop early."""
    perf, cpu = time.perf_counter, time.thread_time
    walls, cpus = [], []
    w0, c0 = perf(), cpu()
    for i, x in enumerate(it):
        train_step(x)
        if agent is not None:
            agent.step(samples=len(x))
        w1, c1 = perf(), cpu()
        walls.append(w1 - w0)
        cpus.append(c1 - c0)
        w0, c0 = w1, c1
        if until is not None and until(i):
            break
    return walls, cpus


def baseline_block(loop, steps):
    batches, train_step = loop
    return timed_steps(batches(steps), train_step)


def agent_block(loop, steps, run_dir, port_base=0, **options):
    import diag

    batches, train_step = loop
    agent = diag.Agent(run_dir=run_dir, export=True, export_port_base=port_base, report=False, verbose=False,
                       **options)
    with agent:
        walls, cpus = timed_steps(agent.loader(batches(steps)), train_step, agent)
    return walls, cpus, agent


def window_block(loop, run_dir, windows=2, tail=10, max_steps=3000, export_in_child=True):
    """Run the default schedule through `windows` windows, each timed until its analysis finished.

    Returns per-step times and, per window, the step range [warm-up step, analysis done + tail).
    The first window also pays for starting the analysis process; later ones reuse it.
    """
    import diag

    batches, train_step = loop
    agent = diag.Agent(run_dir=run_dir, export=True, export_port_base=0, report=False, verbose=False,
                       export_in_child=export_in_child)
    sched = agent.config.profiler
    starts = [sched.skip_first + k * sched.every for k in range(windows)]
    ends: list[int] = []

    def until(i):
        k = len(ends)
        if k < windows and i >= starts[k] + sched.warmup + sched.active and len(agent.windows_analysed) > k:
            ends.append(i + tail)
        return len(ends) == windows and i >= ends[-1]

    with agent:
        walls, cpus = timed_steps(agent.loader(batches(max_steps)), train_step, agent, until=until)
    return walls, cpus, agent, sched, list(zip(starts, ends))


def step_path_cost(run_dir, calls=20000) -> float:
    """Seconds the agent adds per step on the training thread: loader() + step() with no work."""
    import diag

    agent = diag.Agent(run_dir=run_dir, profile=False, export=True, export_port_base=0, report=False, verbose=False)
    items = [None] * calls
    perf = time.perf_counter
    with agent:
        t0 = perf()
        for _ in agent.loader(items):
            agent.step(samples=1)
        agent_s = perf() - t0
    t0 = perf()
    for _ in iter(items):
        pass
    plain_s = perf() - t0
    return (agent_s - plain_s) / calls


def top_costs(run_dir: str, repeats: int = 200) -> tuple[float, float]:
    """(seconds per live.json write, seconds per /metrics render) on a real agent after 40 steps:
    what `diag top` attached at 1 Hz costs the training process each second, on its background
    thread (the write) or its endpoint's thread (the render), holding the GIL at most that long."""
    import diag
    from diag.exporter.registry import render_text

    agent = diag.Agent(run_dir=run_dir, export=True, export_port_base=0, report=False, verbose=False,
                       profile=False, sampling=False)
    with agent:
        for _ in agent.loader(range(40)):
            agent.step(samples=8)
        agent._drain(final=True)
        t0 = time.perf_counter()
        for _ in range(repeats):
            agent._write_live()
        write = (time.perf_counter() - t0) / repeats
        t0 = time.perf_counter()
        for _ in range(repeats):
            render_text([agent.exporter.state])
        render = (time.perf_counter() - t0) / repeats
    return write, render


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _attach_top(how: str, run_dir: str, port: int):
    """A `diag top` process refreshing every second for the whole always-on phase, or None."""
    import subprocess

    if how == "none":
        return None
    os.makedirs(run_dir, exist_ok=True)
    target = [run_dir] if how == "run-dir" else ["--targets", f"127.0.0.1:{port}"]
    return subprocess.Popen([sys.executable, "-m", "diag", "top", *target, "--interval", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=8, help="alternating block pairs for the always-on ratio")
    p.add_argument("--block-steps", type=int, default=60)
    p.add_argument("--windows", type=int, default=3, help="runs of the default schedule (two windows each)")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=96)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--export", choices=("default", "thread", "both"), default="both",
                   help="how windows write their traces: diag's default (a forked child where that stalls "
                        "training less than a thread), always a thread, or runs of each, alternating")
    p.add_argument("--top", choices=("none", "run-dir", "endpoints"), default="none",
                   help="watch the always-on blocks with diag top, from the run directory or the endpoint")
    a = p.parse_args()

    import torch

    torch.set_num_threads(a.threads)
    loop = make_loop(a.width, a.batch)
    skip = 5  # the first steps of a block warm caches; compared alike in both modes
    base_w, base_c, on_w, on_c = [], [], [], []
    sampler_share, thread_share = [], []
    window_rows = []
    stalls: dict[str, list[tuple[float, float, float]]] = {}
    modes = ["default", "thread"] if a.export == "both" else [a.export]
    with tempfile.TemporaryDirectory(prefix="diag-bench-") as tmp:
        baseline_block(loop, 30)  # warm-up
        port = _free_port() if a.top == "endpoints" else 0
        top = _attach_top(a.top, os.path.join(tmp, "on"), port)
        for b in range(a.blocks):
            w, c = baseline_block(loop, a.block_steps)
            base_w += w[skip:]
            base_c += c[skip:]
            run_dir = os.path.join(tmp, "on" if top else f"on{b}")
            w, c, agent = agent_block(loop, a.block_steps, run_dir, port_base=port, profile=False, overwrite=True)
            on_w += w[skip:]
            on_c += c[skip:]
            print(f"block {b + 1}/{a.blocks}: baseline {1000 * statistics.median(base_w[-len(w) + skip:]):.2f} ms, "
                  f"always-on {1000 * statistics.median(w[skip:]):.2f} ms", file=sys.stderr, flush=True)
        if top is not None:
            top.terminate()
            top.wait(10)
        for k in range(a.windows * len(modes)):
            mode = modes[k % len(modes)]
            w, c, agent, sched, spans = window_block(loop, os.path.join(tmp, f"win{k}"),
                                                     export_in_child=(mode == "default"))
            for n, (lo, hi) in enumerate(spans):
                # The reference is the same run's always-on steps next to the window, so
                # the machine's drift between runs does not enter the window's cost.
                near = w[max(skip, lo - 100):lo] if lo - skip >= 50 else w[hi:hi + 100]
                ref = statistics.median(near)
                # The window's last recorded step stops the profiler; the steps after it run
                # beside the trace being written and then analysed.
                last = lo + sched.warmup + sched.active
                stalls.setdefault(mode, []).append((w[last], max(w[last + 1:hi]), ref))
                print(f"run {k + 1} ({mode} export) window {n + 1}: stop step {1000 * w[last]:.0f} ms, slowest "
                      f"following step {1000 * max(w[last + 1:hi]):.0f} ms, median {1000 * ref:.1f} ms",
                      file=sys.stderr, flush=True)
                if mode != modes[0]:
                    continue
                excess = sum(x - ref for x in w[lo:hi])
                ratio = 1.0 + excess / (sched.every * ref)
                window_rows.append((n, excess, ratio))
                print(f"run {k + 1}/{a.windows} window {n + 1}: excess {1000 * excess:.0f} ms over {hi - lo} steps "
                      f"(baseline {1000 * ref:.2f} ms/step) -> run ratio {ratio:.4f}", file=sys.stderr, flush=True)
            wall = sum(w)
            if agent.collectors.sampler is not None and getattr(agent.collectors.sampler, "thread_cpu_s", None) is not None:
                sampler_share.append(agent.collectors.sampler.thread_cpu_s / wall)
            if agent.thread_cpu_s is not None:
                thread_share.append(agent.thread_cpu_s / wall)
        cost = statistics.median(step_path_cost(os.path.join(tmp, f"cost{i}")) for i in range(3))
        write_s, render_s = top_costs(os.path.join(tmp, "topcost"))

    med_base, med_on = statistics.median(base_w), statistics.median(on_w)
    print(f"loop: median step {1000 * med_base:.2f} ms without the agent (width {a.width}, batch {a.batch}, "
          f"{a.threads} thread(s)); {a.blocks} alternating block pairs of {a.block_steps} steps")
    watched = f", diag top attached ({a.top})" if a.top != "none" else ""
    print(f"always-on median step time ratio{watched}: {med_on / med_base:.4f} (target <= 1.005)")
    print(f"always-on median training-thread CPU time ratio: "
          f"{statistics.median(on_c) / statistics.median(base_c):.4f}")
    print(f"step-path cost (loader + step, no training work): {1e6 * cost:.1f} us per step = "
          f"ratio {1 + cost / med_base:.5f} on this loop's {1000 * med_base:.1f} ms steps")
    print(f"what diag top costs the training process, refreshing every second: a live.json write "
          f"{1e3 * write_s:.2f} ms (agent thread) or a /metrics render {1e3 * render_s:.2f} ms (endpoint thread) "
          f"per second, at most {100 * max(write_s, render_s):.3f}% of the training's time (the GIL held that long)")
    if window_rows:
        on_ratio = med_on / med_base
        first = sorted(r for n, _, r in window_rows if n == 0)
        later = sorted(r for n, _, r in window_rows if n > 0)
        steady = statistics.median(later or first)
        print(f"default profiler schedule (a window every {sched.every} steps), whole-run ratio at steady state: "
              f"{on_ratio * steady:.4f} (target <= 1.02) = always-on {on_ratio:.4f} x windows {steady:.4f}; "
              f"windows per run: {', '.join(f'{r:.4f}' for r in later)}")
        print(f"  first window of a run (also starts the analysis process): {statistics.median(first):.4f}; "
              f"per run: {', '.join(f'{r:.4f}' for r in first)}")
    for mode, rows in stalls.items():
        stop = statistics.median(r[0] / r[2] for r in rows)
        after = statistics.median(r[1] / r[2] for r in rows)
        worst = max(r[1] / r[2] for r in rows)
        how = "diag's default" if mode == "default" else "always a thread"
        print(f"window stall, traces written by {how}: the step that stops the profiler takes {stop:.1f}x the "
              f"median step; the slowest step after it {after:.1f}x (worst of {len(rows)} windows {worst:.1f}x)")
    if sampler_share:
        print(f"sampling thread CPU at 1 Hz: {100 * statistics.median(sampler_share):.3f}% of one core (target <= 1%)")
    if thread_share:
        print(f"agent background thread CPU: {100 * statistics.median(thread_share):.3f}% of one core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
