"""Where `diag top` reads a running job: the run directory, or the ranks' metrics endpoints.

- `RunDirSource`: every rank's `live.json` on the shared file system; `p` touches the run
  directory's `profile.trigger`, which every rank watches.
- `EndpointSource`: each rank's `/metrics`, scraped in parallel with a short timeout, for
  ranks on nodes that share no file system; `p` posts `/profile?step=N` to every rank with
  one N, a few steps past the furthest rank, so all ranks profile the same steps.

Each read returns one `RankLive` per rank; a rank that cannot be read this time keeps its last
figures, marked unreachable with the reason. Reads are bounded in time and size.
"""

from __future__ import annotations

import json
import math
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from diag import atomic_io, rundir
from diag.analyzers.job.live import (
    EndpointHistory,
    RankLive,
    rank_from_live_doc,
    rank_from_metrics,
    unreachable,
)
from diag.report import SUMMARY_JSON, read_diagnosis

MAX_LIVE_BYTES = 4 << 20  # a live.json is a few kB; anything near this is not one
MAX_METRICS_BYTES = 2 << 20  # a rank serves under 200 series, some 40 kB
# prometheus_client's parser takes time quadratic in a line's whitespace: no line of diag's
# exposition comes near this, so a longer one is dropped unread.
MAX_LINE_BYTES = 4 << 10
SCRAPE_DEADLINE_READS = 2  # a scrape's whole answer must come within this many read timeouts


def _read_by(resp, limit: int, deadline: float) -> bytes:
    """At most `limit` bytes of an answer, read by `deadline` however slowly they come."""
    chunks, size = [], 0
    while size < limit:
        if time.monotonic() > deadline:
            raise TimeoutError("the answer kept trickling past the refresh's deadline")
        chunk = resp.read1(min(1 << 16, limit - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


# The header that carries the job's token (DIAG_EXPORTER_TOKEN) to an endpoint off this node
# (diag.exporter.server.TOKEN_HEADER; the views import no exporter code).
TOKEN_HEADER = "X-Diag-Token"
# The window starts this many steps past the furthest rank, and at least PROFILE_LEAD_S ahead
# at the ranks' pace: a rank that has passed the step asked for by the time the request reaches
# it starts where it is, and the ranks would profile different steps.
PROFILE_LEAD_STEPS = 5
PROFILE_LEAD_S = 2.0


def profile_step(ranks: list[RankLive]) -> int:
    """The first step of a window asked of every rank: past the furthest rank by
    PROFILE_LEAD_STEPS, or by the steps the fastest rank takes in PROFILE_LEAD_S where more."""
    steps = [r.steps_done for r in ranks if r.steps_done is not None]
    paces = [r.step_ms for r in ranks if r.step_ms is not None and r.step_ms > 0]
    lead = max(PROFILE_LEAD_STEPS, math.ceil(1000.0 * PROFILE_LEAD_S / min(paces)) if paces else 0)
    return (max(steps) if steps else 0) + lead


class RunDirSource:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._last: dict[int, RankLive] = {}

    def describe(self) -> str:
        return f"run directory {self.path}"

    def read(self, now: float | None = None) -> list[RankLive]:
        rd = rundir.RunDir(self.path)
        out = []
        for rank in rd.ranks():
            f = rd.rank_path(rank) / rundir.LIVE_FILE
            problems: list[str] = []
            doc = atomic_io.read_json(f, problems, max_bytes=MAX_LIVE_BYTES)
            if doc is None or doc.get("schema") != "diag.live/1":
                why = problems[0] if problems else f"{f.name}: not written yet (the agent writes it every live_s)"
                if doc is not None:
                    why = f"{f}: not a diag.live/1 document"
                out.append(unreachable(rank, "run_dir", str(f), why, self._last.get(rank)))
                continue
            live = rank_from_live_doc(doc, rank, str(f))
            self._last[rank] = live
            out.append(live)
        return out

    def final(self) -> str | None:
        """The run's own final verdict, once rank 0 has written the report: summary.json's headline."""
        diagnosis = read_diagnosis(self.path / SUMMARY_JSON)
        text = diagnosis.headline.get("text") if diagnosis is not None else None
        return text if isinstance(text, str) else None

    def request_profile(self) -> str:
        trigger = self.path / rundir.TRIGGER_FILE
        atomic_io.atomic_write_text(trigger, f"diag top at {time.time():.3f}\n")
        return f"profiler window requested on every rank ({trigger})"


class EndpointSource:
    def __init__(self, targets: list[str], timeout_s: float = 1.5):
        self.targets = list(dict.fromkeys(targets))
        self.timeout_s = timeout_s
        self._history: dict[str, EndpointHistory] = {t: EndpointHistory() for t in self.targets}
        self._last: dict[str, RankLive] = {}
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(32, len(self.targets))),
                                        thread_name_prefix="diag-top")

    def describe(self) -> str:
        shown = ", ".join(self.targets[:3]) + (f" and {len(self.targets) - 3} more" if len(self.targets) > 3 else "")
        return f"endpoints {shown}"

    def read(self, now: float | None = None) -> list[RankLive]:
        now = time.time() if now is None else now
        bodies = list(self._pool.map(self._scrape, self.targets))
        out = []
        for i, (target, (body, error)) in enumerate(zip(self.targets, bodies)):
            live = None
            if body is not None:
                live, self._history[target], error = parse_scrape(body, self._history[target], now, target)
            if live is None:
                last = self._last.get(target)
                live = unreachable(last.rank if last else -1 - i, "endpoint", target, error or "no answer", last)
            else:
                self._last[target] = live
            out.append(live)
        return out

    def _scrape(self, target: str) -> tuple[str | None, str | None]:
        # The timeout bounds each read; a body that trickles in is bounded by a deadline in all,
        # so one slow endpoint can not hold the screen (each read still ends within the timeout).
        deadline = time.monotonic() + SCRAPE_DEADLINE_READS * self.timeout_s
        try:
            with urllib.request.urlopen(f"http://{target}/metrics", timeout=self.timeout_s) as resp:
                data = _read_by(resp, MAX_METRICS_BYTES + 1, deadline)
        except (OSError, ValueError, urllib.error.URLError) as exc:
            return None, _reason(exc)
        if len(data) > MAX_METRICS_BYTES:
            return None, f"more than {MAX_METRICS_BYTES >> 20} MiB of metrics"
        return data.decode("utf-8", "replace"), None

    def final(self) -> str | None:
        """Endpoints serve no report: a finished run's verdict is in its run directory."""
        return None

    def request_profile(self) -> str:
        step = profile_step(list(self._last.values()))
        answers = list(self._pool.map(lambda t: self._post_profile(t, step), self.targets))
        firsts = sorted({a for a in answers if isinstance(a, int)})
        failed = [a for a in answers if isinstance(a, str)]
        # A rank with a window already asked for or recording answers with that window's step.
        where = f"from step {', '.join(map(str, firsts))}" if firsts else "on no step"
        msg = f"profiler window {where} requested on {len(answers) - len(failed)} of {len(self.targets)} ranks"
        return msg + (f" ({failed[0]})" if failed else "")

    def _post_profile(self, target: str, step: int) -> int | str:
        """The first step the rank will profile, or why it did not answer."""
        # No form content type (urllib's default for a body): the endpoint refuses what a browser could send.
        headers = {"Content-Type": "application/json"}
        if os.environ.get("DIAG_EXPORTER_TOKEN"):
            headers[TOKEN_HEADER] = os.environ["DIAG_EXPORTER_TOKEN"]
        req = urllib.request.Request(f"http://{target}/profile?step={step}", data=b"", method="POST", headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                first = json.loads(resp.read(4096) or b"{}").get("first_step")
        except urllib.error.HTTPError as exc:
            return f"{target}: {exc.code} {exc.reason}"
        except (OSError, ValueError, AttributeError) as exc:
            return f"{target}: {_reason(exc)}"
        return first if isinstance(first, int) and not isinstance(first, bool) else f"{target}: no step in the answer"

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _reason(exc: BaseException) -> str:
    inner = getattr(exc, "reason", None)
    return str(inner if inner is not None else exc)[:160] or type(exc).__name__


def parse_scrape(body: str, history: EndpointHistory, now: float, target: str
                 ) -> tuple[RankLive | None, EndpointHistory, str | None]:
    """(the rank, the history for the next scrape, why there is none) of one scrape's body."""
    try:
        live, history = rank_from_metrics(_series(body), history, now, endpoint=target)
    except ValueError as exc:  # the parser's one error for text that is not an exposition
        return None, history, f"not a Prometheus exposition ({str(exc)[:80]})"
    return live, history, None if live is not None else "no diag rank metrics at this endpoint"


def _series(body: str) -> dict[str, list[tuple[dict, float]]]:
    """{sample name: [(labels, value), ...]} of the diag metrics in an exposition; a value no
    float holds (an integer of hundreds of digits) and a line longer than MAX_LINE_BYTES are
    left out."""
    out: dict[str, list[tuple[dict, float]]] = {}
    if any(len(line) > MAX_LINE_BYTES for line in body.split("\n")):
        body = "\n".join(line for line in body.split("\n") if len(line) <= MAX_LINE_BYTES)
    for fam in text_string_to_metric_families(body):
        if not fam.name.startswith("diag_"):
            continue
        for s in fam.samples:
            try:
                value = float(s.value)
            except (OverflowError, TypeError, ValueError):
                continue
            out.setdefault(s.name, []).append((dict(s.labels), value))
    return out
