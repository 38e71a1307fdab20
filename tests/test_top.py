"""`diag top`: the live judgement above and below each threshold, the two sources, the screen,
the keys, and a real 2-rank demo watched from its run directory and from its endpoints."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diag.analyzers.diagnosis.decision_tree import load_tree
from diag.analyzers.diagnosis.live import judge_live
from diag.analyzers.job.live import EndpointHistory, RankLive, rank_from_live_doc, rank_from_metrics
from diag.exporter.registry import render_text as render_exposition
from diag.exporter.runtime import Handle
from diag.step_record import StepRecord
from diag.top.app import apply_key
from diag.top.screen import ViewState, one_line, render_text, screen
from diag.top.sources import RunDirSource, _series
from tests.conftest import free_port_pair

TREE = load_tree()
TH = TREE.thresholds
NOW = 1_800_000_000.0


def _rank(rank, step_ms=100.0, scatter=0.5, **kw) -> RankLive:
    recent = tuple(step_ms + scatter * ((i % 3) - 1) for i in range(16))
    kw.setdefault("last_step_unix", NOW - 0.1)
    return RankLive(rank=rank, source="run_dir", step_ms=step_ms, recent_step_ms=recent, **kw)


# -- the live judgement ------------------------------------------------------------------------


@pytest.mark.parametrize("extra, named", [(1.1, True), (0.9, False)])
def test_a_rank_waiting_for_data_longer_than_its_peers_is_the_straggler(extra, named):
    """Its peers wait for it inside their collectives, where no step record sees it: the data
    wait is its lag. Named above straggler_step_excess of the peers' step, not below."""
    lag = extra * TH["straggler_step_excess"] * 100.0
    ranks = [_rank(0, data_wait_ms=2.0), _rank(1, data_wait_ms=2.0 + lag), _rank(2, data_wait_ms=2.0)]
    s = judge_live(ranks, TREE, NOW)["straggler"]
    if named:
        assert s["rank"] == 1 and s["cause"] == "data_loader", s
        assert s["data_wait_lag_ms"] == pytest.approx(lag)
    else:
        assert s is None


@pytest.mark.parametrize("extra, named", [(1.1, True), (0.9, False)])
def test_a_rank_whose_pace_is_longer_is_the_pace_setter_and_straggler(extra, named):
    """Waits measured: a rank that waits less for its peers than they wait for it has the longer pace."""
    lag = extra * TH["straggler_step_excess"] * 100.0
    ranks = [_rank(0, wait_ms=lag, device_ms=60.0), _rank(1, wait_ms=0.0, device_ms=60.0 + lag),
             _rank(2, wait_ms=lag, device_ms=60.0)]
    job = judge_live(ranks, TREE, NOW)
    assert job["pace_rank"] == 1  # its lead is far above the noise either way
    if named:
        assert job["straggler"]["rank"] == 1 and job["straggler"]["cause"] == "device"
    else:
        assert job["straggler"] is None


def test_a_lead_within_the_step_scatter_sets_no_pace_and_names_no_straggler():
    ranks = [_rank(0, scatter=20.0), _rank(1, step_ms=104.0, scatter=20.0)]
    job = judge_live(ranks, TREE, NOW)
    assert job["pace_rank"] is None and job["straggler"] is None


def test_a_throttled_device_names_its_clock_event_reasons():
    ranks = [_rank(0, device_ms=60.0), _rank(1, device_ms=60.0),
             _rank(2, device_ms=100.0, clock_events=("hw_thermal_slowdown",), wait_ms=-40.0)]
    s = judge_live(ranks, TREE, NOW)["straggler"]
    assert s["rank"] == 2 and s["cause"] == "throttling" and "hw_thermal_slowdown" in s["text"]


@pytest.mark.parametrize("idle_s, stalled", [(10.5, [1]), (9.5, [])])
def test_a_running_rank_without_a_step_for_long_has_stalled(idle_s, stalled):
    """At least live_stall_min_s (10 s) and live_stall_steps median steps (20 x 0.1 s = 2 s)."""
    ranks = [_rank(0), _rank(1, last_step_unix=NOW - idle_s), _rank(2, status="completed", last_step_unix=NOW - 99)]
    assert judge_live(ranks, TREE, NOW)["stalled"] == stalled


@pytest.mark.parametrize("late_ms, episode", [(30.0, True), (2.0, False)])
def test_the_episode_going_on_is_judged_from_the_ranks_last_steps(late_ms, episode):
    """Rank 2's batches arrive late in every step the live files hold: a persistent episode, shown
    live; 2 ms (under straggler_episode_min_share of a 100 ms step) is none."""
    docs = []
    for rank in range(3):
        doc = _live_doc(rank=rank)
        for i, st in enumerate(doc["steps"]):
            st["data_wait_s"] = 0.001 * (1 + (i % 3) * 0.1) + (late_ms / 1000.0 if rank == 2 else 0.0)
        docs.append(rank_from_live_doc(doc, rank))
    job = judge_live(docs, TREE, NOW)
    if episode:
        assert job["episode"]["kind"] == "persistent" and job["episode"]["rank"] == 2
        text = render_text(screen("src", docs, job, ViewState(), NOW, 1.0), width=200)
        assert "episode: persistent, rank 2, since step 0" in text
    else:
        assert job["episode"] is None


def test_a_persistent_episode_under_the_pace_excess_names_its_rank_live():
    """Rank 2's batches arrive 15 ms late in every step: under straggler_step_excess (25%) of a
    100 ms step, so no pace straggler, but a persistent episode; the straggler field names the
    episode's rank, with the cause, as the report does."""
    docs = []
    for rank in range(3):
        doc = _live_doc(rank=rank)
        for i, st in enumerate(doc["steps"]):
            st["data_wait_s"] = 0.001 * (1 + (i % 3) * 0.1) + (0.015 if rank == 2 else 0.0)
        docs.append(rank_from_live_doc(doc, rank))
    job = judge_live(docs, TREE, NOW)
    assert job["episode"]["kind"] == "persistent" and job["episode"]["rank"] == 2
    s = job["straggler"]
    assert s["rank"] == 2 and s["cause"] == "data_loader" and s["basis"].startswith("a persistent episode")
    line = one_line(docs, job, NOW)
    assert "straggler rank 2 (data_loader)" in line and "episode persistent" in line


def test_a_screen_drawn_once_has_no_key_legend():
    """`diag top --once` takes no keys: its screen ends without the interactive legend."""
    ranks = [_rank(0), _rank(1)]
    job = judge_live(ranks, TREE, NOW)
    live = render_text(screen("src", ranks, job, ViewState(), NOW, 1.0), width=200)
    once = render_text(screen("src", ranks, job, ViewState(), NOW, 1.0, keys=False), width=200)
    assert "q quit" in live and "q quit" not in once
    assert once.splitlines()[:3] == live.splitlines()[:3]


def test_the_job_line_sums_throughput_and_takes_the_common_verdict():
    ranks = [_rank(0, samples_per_s=100.0, bound="compute", mfu=0.4),
             _rank(1, samples_per_s=120.0, bound="compute", mfu=0.5, profiling=True),
             _rank(2, samples_per_s=110.0, bound="data", mfu=0.6)]
    job = judge_live(ranks, TREE, NOW)
    assert job["samples_per_s"] == pytest.approx(330.0)
    assert job["verdict"] == "compute" and job["mfu"] == pytest.approx(0.5) and job["profiling"]


# -- the two sources ---------------------------------------------------------------------------


def _live_doc(**over) -> dict:
    steps = [{"step": i, "start_unix": NOW + i * 0.1, "duration_s": 0.1 + 0.001 * i, "device_s": 0.1 + 0.001 * i,
              "data_wait_s": 0.01, "samples": 32, "tokens": None, "bound": "compute",
              "shares": {"data": 0.1, "host": 0.1, "comm": 0.1, "wait": 0.05, "memory": 0.1, "compute": 0.55}}
             for i in range(20)]
    doc = {"schema": "diag.live/1", "updated_unix": NOW + 2.0, "status": "running", "rank": 1, "host": "node-7",
           "steps_done": 20, "window": {"first_step": 22, "last_step": 24}, "steps": steps,
           "sample": {"t": NOW + 1.9, "gpu": {"utilization_ratio": 0.97, "memory_used_bytes": 3 << 30,
                                               "power_watts": 412.0, "clock_events": ["sw_power_cap"],
                                               "xid_errors_total": 2}}}
    doc.update(over)
    return doc


def test_a_live_doc_gives_the_median_of_the_last_steps():
    r = rank_from_live_doc(_live_doc(), 1)
    last8 = [100.0 + i for i in range(12, 20)]
    assert r.step_ms == pytest.approx(sorted(last8)[3] / 2 + sorted(last8)[4] / 2)
    assert r.device_ms == pytest.approx(r.step_ms) and r.data_wait_ms == pytest.approx(10.0)
    assert r.wait_ms == pytest.approx(0.05 * r.step_ms, rel=0.01)
    assert r.samples_per_s == pytest.approx(8 * 32 / (sum(last8) / 1000.0))
    assert r.last_step_unix == pytest.approx(NOW + 1.9 + 0.119)
    assert (r.window, r.profiling, r.bound, r.xid_errors) == ((22, 24), True, "compute", 2)
    assert r.clock_events == ("sw_power_cap",) and r.host == "node-7"


def test_a_host_that_ran_ahead_of_the_device_steps_at_the_devices_pace():
    """A loop that never syncs launches its steps in 1 ms while each runs 14 ms on the device:
    the device's boundary events give the pace, and the throughput follows it."""
    doc = _live_doc()
    for s in doc["steps"]:
        s.update(duration_s=0.001, device_s=0.014)
    r = rank_from_live_doc(doc, 1)
    assert r.step_ms == pytest.approx(14.0) and r.samples_per_s == pytest.approx(32 / 0.014)
    assert r.last_step_unix == pytest.approx(NOW + 1.9 + 0.001)  # where the host's clock put it


@pytest.mark.parametrize("damage", [
    {"steps": "not a list"}, {"steps": [None, 3, {"duration_s": "x"}, {"duration_s": float("nan")}]},
    {"sample": [1]}, {"window": {"first_step": "a"}}, {"steps_done": True}, {"host": 7},
])
def test_a_damaged_live_doc_gives_what_it_can_and_never_raises(damage):
    r = rank_from_live_doc(_live_doc(**damage), 1)
    assert r.rank == 1


def _exporter_series(handle: Handle) -> dict:
    return _series(render_exposition([handle.state]).decode())


def test_an_endpoint_gives_per_step_figures_from_the_change_between_two_scrapes():
    """The real exporter's exposition, parsed as `diag top` parses a scrape."""
    h = Handle({"run": "r", "rank": "3", "local_rank": 1, "host": "gpu-2", "gpu": "0"})

    def step(i, dur, data):
        h.observe_step(StepRecord(step=i, start_unix=NOW + i, duration_s=dur, data_wait_s=data, samples=64,
                                  device_s=dur * 0.9, shares={"data": data / dur, "host": 0.0, "comm": 0.0,
                                                              "memory": 0.0, "compute": 1 - data / dur}),
                       "data" if data > 0.05 else "compute")

    for i in range(10):
        step(i, 0.2, 0.01)
    first, hist = rank_from_metrics(_exporter_series(h), EndpointHistory(), NOW + 10)
    assert first.rank == 3 and first.host == "gpu-2" and first.steps_done == 10
    assert first.step_ms == pytest.approx(200.0) and first.bound == "compute"
    for i in range(10, 14):
        step(i, 0.5, 0.3)
    second, hist = rank_from_metrics(_exporter_series(h), hist, NOW + 12)
    # Only the 4 new steps: 500 ms each, 300 ms of it waiting for data, 128 samples/s.
    assert second.step_ms == pytest.approx(500.0) and second.data_wait_ms == pytest.approx(300.0)
    assert second.device_ms == pytest.approx(450.0) and second.bound == "data"
    assert second.samples_per_s == pytest.approx(128.0) and second.steps_done == 14
    assert second.last_step_unix == pytest.approx(NOW + 13.5)
    assert hist.step_ms == (500.0,)


def test_no_rank_label_is_no_rank():
    assert rank_from_metrics({"diag_steps_total": [({}, 3.0)]}, EndpointHistory(), NOW)[0] is None


def _run_dir(tmp_path: Path, docs: dict[int, dict | bytes]) -> Path:
    (tmp_path / "manifest.json").write_text(json.dumps({"schema": "diag.run/1", "world_size": len(docs)}))
    for rank, doc in docs.items():
        d = tmp_path / f"rank-{rank:05d}"
        d.mkdir()
        (d / "live.json").write_bytes(doc if isinstance(doc, bytes) else json.dumps(doc).encode())
    return tmp_path


def test_a_run_dir_rank_whose_live_file_is_damaged_is_shown_unreachable_with_its_reason(tmp_path):
    rd = _run_dir(tmp_path, {0: _live_doc(rank=0), 1: b'{"schema": "diag.live/1", "steps": [', 2: {"schema": "x"}})
    ranks = {r.rank: r for r in RunDirSource(rd).read(NOW)}
    assert ranks[0].status == "running" and ranks[0].steps_done == 20
    assert ranks[1].status == "unreachable" and "live.json" in ranks[1].error
    assert ranks[2].status == "unreachable" and "not a diag.live/1" in ranks[2].error


# -- the screen and the keys -------------------------------------------------------------------


def test_names_from_the_job_cannot_drive_the_terminal(tmp_path):
    import io

    from rich.console import Console

    hostile = "evil\x1b]0;owned\x07\x1b[2J\u202e"
    ranks = [rank_from_live_doc(_live_doc(host=hostile, status=hostile), 0)]
    job = judge_live(ranks, TREE, NOW)
    console = Console(file=io.StringIO(), force_terminal=True, width=200, color_system="truecolor")
    console.print(screen(hostile, ranks, job, ViewState(opened=0), NOW, 1.0))
    out = console.file.getvalue()
    assert "\x1b]0;" not in out and "\x1b[2J" not in out and "\u202e" not in out and "\x07" not in out
    assert "evil\\x1b]0;owned" in out


def test_keys_sort_open_and_request_a_window(tmp_path):
    rd = _run_dir(tmp_path, {0: _live_doc(rank=0), 1: _live_doc(rank=1, host="slow")})
    source = RunDirSource(rd)
    ranks = source.read(NOW)
    state = ViewState()
    for key in ("s", "r", "down", "enter"):
        assert apply_key(key, state, ranks, source)
    assert (state.sort, state.reverse, state.opened) == ("step", True, 1)  # equal steps: rank order, second row
    text = render_text(screen("src", ranks, judge_live(ranks, TREE, NOW), state, NOW, 1.0), width=170)
    assert "rank 1 on slow" in text and "clock events: sw_power_cap" in text
    assert "step ms v" in text
    assert apply_key("p", state, ranks, source)
    assert (rd / "profile.trigger").exists() and "requested on every rank" in state.message
    assert not apply_key("q", state, ranks, source)


# -- a real running job ------------------------------------------------------------------------

DEMO_STEPS = 400  # long enough to watch; the test stops it


@pytest.fixture(scope="module")
def running_demo(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("top")
    base = free_port_pair()
    run_dir = tmp / "demo"
    log = open(tmp / "demo.log", "w")  # noqa: SIM115 - closed below
    env = {**os.environ, "DIAG_RUN_LIVE_S": "0.5", "DIAG_RUN_FLUSH_S": "1"}
    # Rank 1's batches arrive late in every step: the live episode to see.
    p = subprocess.Popen([sys.executable, "-m", "diag", "demo", "--run-dir", str(run_dir), "--port-base", str(base),
                          "--steps", str(DEMO_STEPS), "--linger", "30", "--straggler", "persistent"], stdout=log,
                         stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.time() + 90
    while time.time() < deadline and not all(_steps_done(run_dir, r) >= 8 for r in (0, 1)):
        assert p.poll() is None, (tmp / "demo.log").read_text()[-2000:]
        time.sleep(0.5)
    yield run_dir, [f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"]
    os.killpg(p.pid, 15)
    p.wait(30)
    log.close()


def _steps_done(run_dir: Path, rank: int) -> int:
    try:
        return int(json.loads((run_dir / f"rank-{rank:05d}" / "live.json").read_text())["steps_done"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def _top(*args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diag", "top", *args], capture_output=True, text=True,
                          timeout=timeout)


def _rows(text: str) -> dict[int, list[str]]:
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("│")]
        if len(cells) > 5 and cells[0].isdigit():
            rows[int(cells[0])] = cells
    return rows


@pytest.mark.slow
def test_top_shows_a_running_demo_from_its_run_directory_and_from_its_endpoints(running_demo):
    run_dir, targets = running_demo
    for args in ([str(run_dir)], ["--targets", ",".join(targets)]):
        out = _top(*args, "--once", "--width", "170")
        assert out.returncode == 0, out.stderr
        rows = _rows(out.stdout)
        assert sorted(rows) == [0, 1], out.stdout
        for cells in rows.values():
            assert cells[2].startswith("running") and int(cells[3]) > 0, cells  # status (profiling or not), steps
            assert float(cells[4]) > 0 and float(cells[6]) >= 0  # step ms, data ms
        assert "ranks 2/2 running" in out.stdout and "samples/s" in out.stdout
        assert "q quit" not in out.stdout  # drawn once: no keys to press
        if args[0] == str(run_dir):  # the live files hold the last steps: the episode going on
            assert "episode: persistent, rank 1" in out.stdout, out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("source", ["run_dir", "endpoints"])
def test_top_refreshes_within_two_seconds_as_the_steps_go_on(running_demo, source):
    run_dir, targets = running_demo
    args = [str(run_dir)] if source == "run_dir" else ["--targets", ",".join(targets)]
    out = _top(*args, "--iterations", "4", "--interval", "1")  # stdout is a pipe: one line per refresh
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 4, out.stdout
    steps = [int(line.split("steps ")[1].split()[0]) for line in lines]
    assert steps[-1] > steps[0], lines  # the job moved on between the first refresh and the last
    stamps = [time.strptime(line.split()[0], "%H:%M:%S") for line in lines]
    gaps = [(time.mktime(b) - time.mktime(a)) for a, b in zip(stamps, stamps[1:])]
    assert all(g <= 2 for g in gaps), lines


@pytest.mark.slow
def test_p_on_the_terminal_requests_a_window_on_every_rank(running_demo):
    """`diag top` on a real terminal (a pty): `p` touches the trigger, every rank answers with a
    window; `q` ends it and gives the terminal back."""
    run_dir, targets = running_demo
    pid, fd = pty.fork()
    if pid == 0:
        os.environ["COLUMNS"], os.environ["LINES"] = "160", "40"
        os.execv(sys.executable, [sys.executable, "-m", "diag", "top", str(run_dir), "--interval", "0.5"])
    screen_text = _read_until(fd, "profile every rank", 30)
    os.write(fd, b"p")
    screen_text += _read_until(fd, "requested on every rank", 10)
    os.write(fd, b"q")
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0
    assert (run_dir / "profile.trigger").exists()
    deadline = time.time() + 30
    while time.time() < deadline:
        if all("on-demand window requested" in _events(run_dir, r) for r in (0, 1)):
            break
        time.sleep(0.5)
    assert all("on-demand window requested" in _events(run_dir, r) for r in (0, 1))


@pytest.mark.parametrize("step_ms,done,first", [
    (10.0, (40, 42), 42 + 200),  # 2 s ahead at the faster rank's pace
    (1000.0, (40, 42), 42 + 5),  # slow steps: the step lead
    (None, (40, None), 45),  # no pace read yet
])
def test_a_window_asked_of_every_rank_starts_far_enough_ahead_for_all(step_ms, done, first):
    """A rank already past the step asked for starts its window where it is: the step asked is
    ahead of the furthest rank by two seconds of the fastest rank's steps, at least 5 steps."""
    from diag.top.sources import profile_step

    ranks = [RankLive(rank=0, source="endpoint", step_ms=step_ms, steps_done=done[0]),
             RankLive(rank=1, source="endpoint", step_ms=step_ms and step_ms * 1.5, steps_done=done[1])]
    assert profile_step(ranks) == first


@pytest.mark.slow
def test_p_over_the_endpoints_asks_every_rank_for_the_same_steps(running_demo):
    from diag.top.sources import EndpointSource

    run_dir, targets = running_demo
    source = EndpointSource(targets)
    try:
        ranks = source.read()
        assert all(r.status == "running" for r in ranks), ranks
        msg = source.request_profile()
    finally:
        source.close()
    # Both ranks answer with one step: the new window, or the one already asked for or recording.
    assert "requested on 2 of 2 ranks" in msg and re.search(r"from step \d+ requested", msg), msg
    step = int(msg.split("from step ")[1].split()[0])
    deadline = time.time() + 20
    while time.time() < deadline and not all(f"requested at step {step}" in _events(run_dir, r) for r in (0, 1)):
        time.sleep(0.5)
    assert all(f"requested at step {step}" in _events(run_dir, r) for r in (0, 1))


def _read_until(fd: int, needle: str, timeout_s: float) -> str:
    buf, deadline = b"", time.time() + timeout_s
    while time.time() < deadline and needle.encode() not in buf:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                buf += os.read(fd, 65536)
            except OSError:
                break
    text = buf.decode("utf-8", "replace")
    assert needle in text, text[-2000:]
    return text


def _events(run_dir: Path, rank: int) -> str:
    """A rank's events as written so far: its sealed segments and the open one, which the agent
    appends to every second and seals every 10 s (segments.segment_files)."""
    from diag import segments

    return "".join(p.read_text() for p in segments.segment_files(run_dir / f"rank-{rank:05d}" / "events", "events"))


def test_an_agent_answers_one_profile_request_at_a_time(tmp_path):
    """POST /profile on a real agent's endpoint: the first request sets the window's step; a second,
    before that window ran, gets the same step back rather than another window; a bad step is 400."""
    import urllib.error
    import urllib.request

    import diag

    with diag.Agent(run_dir=tmp_path / "run", export=True, export_port_base=0, report=False, sampling=False,
                    verbose=False, profile_on_demand=True) as agent:
        url = f"http://127.0.0.1:{agent.exporter.port}/profile"

        def post(query: str, ctype: str = "application/json") -> dict:
            req = urllib.request.Request(url + query, data=b"", method="POST", headers={"Content-Type": ctype})
            with urllib.request.urlopen(req, timeout=10) as resp:
                return json.loads(resp.read())

        with pytest.raises(urllib.error.HTTPError) as form:  # what a web page's form could send
            post("?step=40", ctype="application/x-www-form-urlencoded")
        assert form.value.code == 403
        assert post("?step=40") == {"first_step": 40}
        assert post("?step=90") == {"first_step": 40}
        with pytest.raises(urllib.error.HTTPError) as bad:
            post("?step=-3")
        assert bad.value.code == 400
        assert agent.windows.requested_step == 40


def test_a_scrape_of_long_whitespace_lines_is_read_in_bounded_time():
    """prometheus_client's parser is quadratic in a line's whitespace (found by the fuzzer: a
    half-megabyte line took minutes); such lines are dropped, the rest of the scrape still read."""
    from diag.analyzers.job.live import EndpointHistory
    from diag.top.sources import MAX_METRICS_BYTES, parse_scrape

    h = Handle({"run": "r", "rank": "2", "local_rank": 0, "host": "h", "gpu": ""})
    h.observe_step(StepRecord(step=0, start_unix=NOW, duration_s=0.1, data_wait_s=0.0))
    good = render_exposition([h.state]).decode()
    hostile = ("# HELP" + "\t" * 500_000 + "x\n") + good
    started = time.perf_counter()
    live, _, error = parse_scrape(hostile, EndpointHistory(), NOW, "h:1")
    assert error is None and live.rank == 2 and live.steps_done == 1
    worst = ("# HELP" + "\t" * 4000 + "x\n") * (MAX_METRICS_BYTES // 4000)
    parse_scrape(worst, EndpointHistory(), NOW, "h:1")
    assert time.perf_counter() - started < 30.0  # linear: the quadratic reader took minutes


def test_an_endpoint_whose_answer_trickles_is_given_up_by_its_deadline():
    """A server that sends its headers, then one byte of body every 0.1 s, forever: each read
    ends well within the timeout, so only a deadline on the whole answer ends the scrape. The
    other endpoint is still read (diag top draws its frame)."""
    import socket
    import threading

    from diag.top.sources import EndpointSource

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    stop = threading.Event()

    def trickle():
        conn, _ = listener.accept()
        conn.recv(4096)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 100000000\r\n\r\n")
        try:
            while not stop.wait(0.1):
                conn.sendall(b"#")
        except OSError:
            pass
        conn.close()

    threading.Thread(target=trickle, daemon=True).start()
    source = EndpointSource([f"127.0.0.1:{listener.getsockname()[1]}"], timeout_s=0.5)
    start = time.monotonic()
    (rank,) = source.read()
    took = time.monotonic() - start
    stop.set()
    listener.close()
    assert took < 10.0, took  # the deadline (2 x 0.5 s) and one read, not forever
    assert rank.status == "unreachable" and "trickling" in (rank.error or ""), rank


def test_top_ends_with_the_job_and_shows_its_final_diagnosis(tmp_path):
    """Every rank ended: the full-screen view leaves its last frame on the terminal and returns at
    once (it used to stay on "ranks 0/2 running" until q), with the run's own final verdict."""
    import io

    from rich.console import Console

    from diag.top.app import run_lines, run_screen
    from diag.top.screen import one_line

    rd = _run_dir(tmp_path, {0: _live_doc(rank=0, status="completed"), 1: _live_doc(rank=1, status="completed")})
    headline = "Compute-bound: compute kernels 64% of step time on both ranks."
    (rd / "summary.json").write_text(json.dumps({"schema": "diag.report_summary/2",
                                                 "diagnosis": {"schema": "diag.diagnosis/1",
                                                               "headline": {"text": headline}}}))
    out = io.StringIO()
    console = Console(file=out, width=170, color_system=None, force_terminal=True)
    t0 = time.monotonic()
    assert run_screen(RunDirSource(rd), TREE, console, interval_s=30.0, iterations=None, keys_stream=io.StringIO()) == 0
    assert time.monotonic() - t0 < 10  # not one 30 s refresh
    assert f"finished: {headline}" in out.getvalue()
    lines = io.StringIO()
    assert run_lines(RunDirSource(rd), TREE, lines, interval_s=30.0, iterations=None) == 0
    assert lines.getvalue().count("\n") == 1 and f"finished: {headline}" in lines.getvalue()
    ranks = RunDirSource(rd).read(NOW)
    assert "finished" not in one_line(ranks, judge_live(ranks, TREE, NOW), NOW)  # no final diagnosis passed
