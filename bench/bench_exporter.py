"""Exporter speed: scrape latency of one rank's endpoint, and its cost to the training step.

    python bench/bench_exporter.py [--scrapes 500] [--rounds 12] [--steps 40]

1. Scrape: one rank's endpoint with the default metrics all populated (steps, a GPU and
   host sample, a profiler window, NCCL results) is scraped over loopback HTTP many times
   (a new connection each time, as Prometheus does after an idle interval); median and
   p95 of the full request time are printed against the 5 ms budget.
2. Step time: a CPU training loop of ~20 ms steps (a matmul on one thread) runs without
   and with the exporter, in interleaved blocks. "With" means what the agent does: one
   observe_step per step, one observe_sample per second, and a scrape every second from
   another thread (which competes with the loop for the GIL, as a real scrape would; a
   real Prometheus scrapes every 15 s, so this is 15 times harsher). Median step times and
   their ratio are printed.

No competitor runs here: dcgm-exporter needs an NVIDIA GPU and knows nothing of steps.
"""

from __future__ import annotations

import argparse
import http.client
import statistics
import threading
import time

import torch

from diag.exporter import runtime


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def populated_handle():
    h = runtime.start({"run": "bench", "rank": 0, "local_rank": 0, "host": "node", "gpu": "0"},
                      port_base=0, bind="127.0.0.1", log=lambda m: None)
    now = time.time()
    for i in range(100):
        h.observe_step(step_record(i, now))
    gpu = {"index": 0, "uuid": "GPU-0", "name": "NVIDIA H100", "utilization_ratio": 0.9,
           "memory_used_bytes": 7e10, "memory_total_bytes": 8e10, "sm_clock_hz": 1.9e9, "power_watts": 600.0,
           "energy_joules_total": 1e6, "temperature_celsius": 70.0, "clock_events": ["sw_power_cap"],
           "pcie_tx_bytes_per_second": 1e9, "pcie_rx_bytes_per_second": 1e9, "nvlink_tx_bytes_total": 1e12,
           "nvlink_rx_bytes_total": 1e12, "ecc_errors_total": 0, "xid_errors_total": 0}
    host = {"cpu_ratio": 0.3, "memory_used_bytes": 1e11, "memory_total_bytes": 5e11,
            "disk_read_bytes_total": 1e9, "disk_write_bytes_total": 1e9, "net_rx_bytes_total": 1e9,
            "net_tx_bytes_total": 1e9, "process_cpu_ratio": 1.0, "process_rss_bytes": 8e9,
            "dataloader_workers": 8, "dataloader_workers_cpu_ratio": 2.0}
    h.observe_sample({"t": now, "gpu": gpu, "host": host})
    h.observe_sample({"t": now + 1, "gpu": gpu, "host": host})
    h.observe_window({"mfu": 0.4, "gpu_time": {"comm_compute_overlap_pct": 50.0},
                      "findings": [{"id": f"finding_{i}"} for i in range(5)]})
    h.observe_nccl({"schema": "diag.nccl_bench/1", "tests": [
        {"collective": c, "avg_busbw_gbps": 100.0} for c in ("all_reduce", "all_gather", "reduce_scatter")]})
    h.observe_nccl({"schema": "diag.nccl_log/1", "findings": [{"id": "nccl_socket_transport"}]})  # a saved /1 document
    return h


def step_record(i, now):
    return {"step": i, "start_unix": now, "duration_s": 0.02, "data_wait_s": 0.001, "samples": 32,
            "tokens": 32 * 512, "peak_mem_bytes": 6e10, "profiled": False, "bound": "compute",
            "evidence": "sampled", "shares": {"data": 0.05, "host": 0.05, "comm": 0.1, "memory": 0.2,
                                              "compute": 0.6}}


def scrape_once(port) -> tuple[float, int]:
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/metrics")
    body = conn.getresponse().read()
    conn.close()
    return time.perf_counter() - t0, len(body)


def bench_scrape(n: int) -> None:
    h = populated_handle()
    try:
        for _ in range(20):
            scrape_once(h.port)
        times, size = [], 0
        for _ in range(n):
            dt, size = scrape_once(h.port)
            times.append(dt * 1e3)
        conn = http.client.HTTPConnection("127.0.0.1", h.port, timeout=10)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
        series = sum(1 for ln in text.splitlines() if ln and not ln.startswith("#"))
        med, p95 = statistics.median(times), pct(times, 0.95)
        print(f"scrape: {n} scrapes of one rank's endpoint ({series} series, {size} bytes), new connection "
              f"each: median {med:.2f} ms, p95 {p95:.2f} ms, max {max(times):.2f} ms "
              f"(budget 5 ms: {'ok' if p95 <= 5 else 'OVER'})")
        # Prometheus keeps its connection to a target open between scrapes.
        conn = http.client.HTTPConnection("127.0.0.1", h.port, timeout=10)
        kept = []
        for _ in range(n):
            t0 = time.perf_counter()
            conn.request("GET", "/metrics")
            conn.getresponse().read()
            kept.append((time.perf_counter() - t0) * 1e3)
        conn.close()
        print(f"        same, one kept-alive connection: median {statistics.median(kept):.2f} ms, "
              f"p95 {pct(kept, 0.95):.2f} ms, max {max(kept):.2f} ms")
        rec = step_record(0, time.time())
        k = 20000
        t0 = time.perf_counter()
        for _ in range(k):
            h.observe_step(rec)
        print(f"observe_step: {(time.perf_counter() - t0) / k * 1e6:.1f} us per call")
    finally:
        h.close()


def make_work(target_s: float):
    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    reps = 1

    def work():
        x = a
        for _ in range(reps):
            x = torch.tanh(x @ a) * 0.5
        return x

    work()
    per = []
    for _ in range(15):
        t0 = time.perf_counter()
        work()
        per.append(time.perf_counter() - t0)
    reps = max(1, round(target_s / min(per)))  # the unloaded time: a busy machine only slows it
    return work


def run_block(work, steps: int, handle) -> list[float]:
    times = []
    last_sample = time.monotonic()
    for i in range(steps):
        t0 = time.perf_counter()
        start_unix = time.time()
        work()
        dt = time.perf_counter() - t0
        times.append(dt)
        if handle is not None:
            handle.observe_step({"step": i, "start_unix": start_unix, "duration_s": dt, "data_wait_s": 0.0,
                                 "samples": 32, "tokens": None, "peak_mem_bytes": None, "profiled": False,
                                 "bound": "compute", "evidence": "sampled", "shares": None})
            if time.monotonic() - last_sample >= 1.0:
                last_sample = time.monotonic()
                handle.observe_sample({"t": time.time(), "host": {"cpu_ratio": 0.5}})
    return times


def bench_steps(rounds: int, steps: int) -> None:
    work = make_work(0.020)
    h = populated_handle()
    stop = threading.Event()

    def scraper():  # one scrape per second, as a (harsh) Prometheus would
        while not stop.wait(1.0):
            scrape_once(h.port)

    t = threading.Thread(target=scraper, daemon=True)
    t.start()
    without, with_ = [], []
    try:
        for r in range(rounds):
            order = (None, h) if r % 2 == 0 else (h, None)
            for handle in order:
                (with_ if handle is not None else without).extend(run_block(work, steps, handle))
    finally:
        stop.set()
        t.join(5)
        h.close()
    m0, m1 = statistics.median(without), statistics.median(with_)
    print(f"step time: {rounds} interleaved rounds x {steps} steps each way: median without exporter "
          f"{m0 * 1e3:.3f} ms, with exporter (observe_step every step, a sample and a scrape every second) "
          f"{m1 * 1e3:.3f} ms, ratio {m1 / m0:.4f}")
    print(f"           p95 without {pct(without, 0.95) * 1e3:.3f} ms, with {pct(with_, 0.95) * 1e3:.3f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scrapes", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    bench_scrape(args.scrapes)
    bench_steps(args.rounds, args.steps)


if __name__ == "__main__":
    main()
