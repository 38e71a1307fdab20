"""Run directories and analysis documents for the report tests, written the way the agent does.

They are inputs (run directories (diag.run/1) through diag.rundir, diag.analysis/1 documents), never expected outputs:
the tests compute what the report must say from the numbers put in here.
"""

from __future__ import annotations

import random
from pathlib import Path

from diag import atomic_io, rundir, segments

CLASSES = ("data", "host", "comm", "memory", "compute")


def shares_for(bound: str, strength: float = 0.5) -> dict:
    """Five shares summing to 1 with `bound` holding `strength` of the step."""
    rest = (1 - strength) / 4
    return {p: (strength if p == bound else rest) for p in CLASSES}


def write_run(
    root: Path,
    ranks: int = 2,
    steps: int = 40,
    bound: str = "data",
    strength: float = 0.5,
    step_s: float = 0.05,
    slow_rank: int | None = None,
    samples: bool = True,
    gpu: bool = False,
    windows: bool = True,
    hostname: str = "node-a",
    kernel_name: str = "aten::mm",
    world_size: int | None = None,
    seed: int = 0,
    step_segment: int = 200,
    data_wait: bool = True,
    jitter: float = 0.05,
) -> Path:
    rng = random.Random(seed)
    world = world_size or ranks
    atomic_io.atomic_write_json(root / rundir.MANIFEST, {
        "schema": rundir.RUN_SCHEMA, "run": root.name, "world_size": world, "backend": "gloo",
        "hosts": [hostname], "start_unix": 1_700_000_000.0, "end_unix": 1_700_000_000.0 + steps * step_s,
    })
    t0 = 1_700_000_000.0
    for r in range(ranks):
        rp = root / rundir.rank_dir_name(r)
        atomic_io.atomic_write_json(rp / rundir.RANK_FILE, {
            "schema": rundir.RANK_SCHEMA, "rank": r, "world_size": world, "hostname": hostname,
            "device": "cpu", "backend": "gloo",
        })
        w = segments.SegmentWriter(rp / "steps", "steps", flush_records=step_segment, flush_seconds=1e9)
        sh = shares_for(bound, strength)
        durations = {}
        for s in range(steps):
            d = durations[s] = step_s * (1.6 if r == slow_rank else 1.0) * (1 + jitter * rng.random())
            w.write({
                "step": s, "start_unix": t0 + s * step_s, "duration_s": d,
                "data_wait_s": d * sh["data"] if data_wait else None,
                "samples": 32, "tokens": None,
                "peak_mem_bytes": (3 << 30) if gpu else None, "profiled": windows and 10 <= s < 13,
                "bound": bound, "evidence": "trace" if windows and 10 <= s < 13 else "sampled",
                "shares": sh,
            })
        w.flush()
        if samples:
            sw = segments.SegmentWriter(rp / "samples", "samples", flush_records=10_000, flush_seconds=1e9)
            for i in range(max(2, int(steps * step_s))):
                g = None
                if gpu:
                    g = {"index": r, "name": "NVIDIA A100-SXM4-80GB", "utilization_ratio": 0.5 + 0.4 * rng.random(),
                         "memory_used_bytes": 4 << 30, "memory_total_bytes": 80 << 30,
                         "sm_clock_hz": 1.41e9 if i % 7 else 1.1e9, "power_watts": 250.0,
                         "temperature_celsius": 60.0,
                         "clock_events": ["sw_power_cap"] if i % 7 == 0 else []}
                sw.write({"t": t0 + i, "gpu": g, "host": {"cpu_ratio": 0.3 + 0.1 * rng.random(),
                                                          "memory_used_bytes": 8 << 30,
                                                          "memory_total_bytes": 24 << 30,
                                                          "process_rss_bytes": 1 << 30}})
            sw.flush()
        if windows:
            atomic_io.atomic_write_json(rp / rundir.WINDOWS / "window-000010.json", {
                "first_step": 10, "last_step": 12, "trace": "t.pt.trace.json.gz",
                "analysis": analysis_rank(r, world, bound, strength, kernel_name=kernel_name,
                                          steps=[s for s in range(10, 13) if s in durations], step_s=step_s,
                                          durations=durations),
            })
    return root


def analysis_rank(rank: int, world: int, bound: str, strength: float = 0.5, kernel_name: str = "aten::mm",
                  steps=range(3), step_s: float = 0.05, collectives: list | None = None, host: str | None = None,
                  durations: dict | None = None):
    """One rank of a diag.analysis/1 document; a trace of the same steps measures the same durations."""
    sh = shares_for(bound, strength)
    durations = durations or {}
    d = {
        "rank": rank, "source": f"rank{rank}.pt.trace.json.gz", "device": "cpu", "world_size": world,
        "bound": bound,
        "steps": [{"step": s, "duration_ms": durations.get(s, step_s) * 1000, "bound": bound, "shares": sh, "path": [],
                   "evidence": "trace"} for s in steps],
        "gpu_time": {"idle_pct": 10.0, "compute_pct": 80.0, "non_compute_pct": 10.0,
                     "comm_compute_overlap_pct": 20.0},
        "findings": [],
        "top_kernels": [{"name": kernel_name, "class": "compute", "time_ms": 12.5, "count": 30, "pct": 40.0,
                         "intensity": 85.0},
                        {"name": "aten::add_", "class": "memory", "time_ms": 3.0, "count": 90, "pct": 9.0,
                         "intensity": 0.2}],
        "top_ops": [{"name": kernel_name, "class": "compute", "time_ms": 14.0, "count": 30, "pct": 44.0}],
        "collectives": collectives or [],
        "mfu": None, "fixes": [], "path": [],
    }
    if host:
        d["host"] = host
    return d


# ---------------------------------------------------------------------------- headless Chromium


class Browser:
    """Headless Chromium driven over the DevTools protocol (CDP) on a loopback websocket.

    Why CDP rather than --dump-dom and --enable-logging: it reports console errors and
    uncaught exceptions as structured events, sees JavaScript dialogs (alert) as they
    open, lets us wait until the charts are drawn instead of guessing a time budget, and
    queries the live DOM. Needs the `websocket-client` package (a test dependency).
    """

    def __init__(self, chromium: str, user_data_dir: Path, timeout: float = 30.0):
        import re
        import subprocess
        import time

        import websocket  # websocket-client

        self.timeout = timeout
        self.proc = subprocess.Popen(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={user_data_dir}", "--remote-debugging-port=0",
             "--remote-debugging-address=127.0.0.1", "--window-size=1280,900", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        url = None
        deadline = time.monotonic() + timeout
        lines = []
        try:
            while time.monotonic() < deadline:
                line = self.proc.stderr.readline()
                if not line:
                    if self.proc.poll() is not None:
                        break
                    continue
                lines.append(line)
                m = re.search(r"DevTools listening on (ws://\S+)", line)
                if m:
                    url = m.group(1)
                    break
            if url is None:
                raise RuntimeError("chromium did not open a DevTools port:\n" + "".join(lines[-20:]))
            self.ws = websocket.create_connection(url, timeout=timeout, suppress_origin=True)
        except BaseException:
            self.close()
            raise
        # Drain stderr so chromium never blocks on a full pipe.
        import threading

        threading.Thread(target=self._drain, daemon=True).start()
        self._id = 0
        self.events: list[dict] = []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable", session=True)

    def _drain(self):
        try:
            for _ in self.proc.stderr:
                pass
        except (OSError, ValueError):
            pass

    def call(self, method: str, session: bool = False, **params) -> dict:
        import json
        import time

        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        self.ws.send(json.dumps(msg))
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            reply = json.loads(self.ws.recv())
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self._on_event(reply)
        raise TimeoutError(method)

    def _on_event(self, ev: dict) -> None:
        self.events.append(ev)
        if ev.get("method") == "Page.javascriptDialogOpening":
            # Dismiss it so the page does not stay blocked; the test sees the event.
            import json

            self._id += 1
            self.ws.send(json.dumps({"id": self._id, "method": "Page.handleJavaScriptDialog",
                                     "params": {"accept": True}, "sessionId": self.session}))

    def pump(self, seconds: float) -> None:
        """Receive events for a while (e.g. after load)."""
        import json
        import time

        import websocket

        end = time.monotonic() + seconds
        self.ws.settimeout(0.1)
        try:
            while time.monotonic() < end:
                try:
                    self._on_event(json.loads(self.ws.recv()))
                except websocket.WebSocketTimeoutException:
                    pass
        finally:
            self.ws.settimeout(self.timeout)

    def eval(self, expression: str):
        r = self.call("Runtime.evaluate", session=True, expression=expression, returnByValue=True,
                      awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"evaluate failed: {r['exceptionDetails']}")
        return r["result"].get("value")

    def open(self, url: str, wait_for: str, timeout: float | None = None) -> float:
        """Navigate and wait until the JS expression `wait_for` is true; returns seconds taken."""
        import time

        t0 = time.monotonic()
        self.call("Page.navigate", session=True, url=url)
        end = t0 + (timeout or self.timeout)
        while time.monotonic() < end:
            try:
                if self.eval(wait_for):
                    return time.monotonic() - t0
            except RuntimeError:
                pass
            self.pump(0.05)
        raise TimeoutError(f"page {url} never satisfied {wait_for}")

    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions and log errors seen so far."""
        out = []
        for ev in self.events:
            m, p = ev.get("method"), ev.get("params", {})
            if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append("console: " + " ".join(str(a.get("value", a.get("description"))) for a in p["args"]))
            elif m == "Runtime.exceptionThrown":
                d = p.get("exceptionDetails", {})
                out.append("exception: " + str(d.get("exception", {}).get("description") or d.get("text")))
            elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                out.append("log: " + str(p["entry"].get("text")))
        return out

    def dialogs(self) -> list[str]:
        return [str(e["params"].get("message")) for e in self.events if e.get("method") == "Page.javascriptDialogOpening"]

    def screenshot(self, path: Path) -> None:
        import base64

        height = int(self.eval("Math.ceil(document.documentElement.scrollHeight)") or 900)
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=1280, height=min(height, 16000),
                  deviceScaleFactor=1, mobile=False)
        self.pump(0.5)  # let responsive charts re-layout to the new viewport
        data = self.call("Page.captureScreenshot", session=True, format="png", captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        ws = getattr(self, "ws", None)
        if ws is not None:
            try:
                ws.close()
            except Exception:
                pass
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()
                self.proc.wait(timeout=10)


# JavaScript: what the charts on the page look like once drawn.
CHART_STATE_JS = """(() => {
  const charts = Array.from(document.querySelectorAll('[data-chart]'));
  return charts.map(el => ({
    id: el.id,
    plotly: el.classList.contains('js-plotly-plot'),
    svgs: el.querySelectorAll('.main-svg').length,
    traces: el.querySelectorAll('g.trace, g.hm, .heatmaplayer image, g.scatterlayer .trace, g.barlayer .trace').length,
    points: el.querySelectorAll('path.point, .scatterlayer path.js-line, .heatmaplayer image').length,
    data: (el.data || []).length,
  }));
})()"""
CHARTS_DRAWN_JS = """(() => {
  const c = Array.from(document.querySelectorAll('[data-chart]'));
  return c.length > 0 && c.every(el => el.classList.contains('js-plotly-plot') && el.querySelector('.main-svg'));
})()"""
