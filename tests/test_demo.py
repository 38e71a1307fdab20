"""`diag demo --bottleneck X` induces X for real, and `diag analyze RUN_DIR --json` agrees."""

from __future__ import annotations

import html
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import free_port_pair, wait_for_line

from diag import rundir
from diag.demo import BOTTLENECKS, schedule

STEPS = 16


def _env() -> dict:
    return dict(os.environ, DIAG_EXPORTER="off")


def _diag(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "diag", *args], capture_output=True, text=True,
                          timeout=timeout, env=_env())


def _warnings(doc: dict) -> list[dict]:
    found = list((doc.get("job") or {}).get("findings") or [])
    for r in doc.get("ranks") or []:
        found += r.get("findings") or []
    return [f for f in found if f.get("severity") in ("warning", "error", "critical")]


# The ranks' work is equal by construction, and they share this machine's CPUs with each other
# and whatever else runs: a rank that falls behind here is contended, never unevenly loaded.
CONTENTION = {"cpu_contention", "busy_cpu"}


def _unexplained_warnings(doc: dict) -> list[dict]:
    return [f for f in _warnings(doc)
            if not (f["id"] == "straggler" and f["evidence"].get("likely_cause") in CONTENTION)]


def _diag_stamped(*args, timeout=240) -> tuple[subprocess.CompletedProcess, list[tuple[float, str]]]:
    """diag run as _diag does, and each line of its stderr with the seconds since the command
    started at which it arrived."""
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "diag", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env())
    lines: list[tuple[float, str]] = []

    def read_stderr():
        for line in proc.stderr:
            lines.append((time.monotonic() - started, line))

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    out = proc.stdout.read()  # until the command exits (pytest-timeout bounds the test)
    proc.wait(timeout)
    reader.join(30)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "".join(line for _, line in lines)), lines


def _run_demo(bottleneck: str, run_dir):
    proc, lines = _diag_stamped("demo", "--bottleneck", bottleneck, "--steps", str(STEPS), "--run-dir", str(run_dir),
                                "--no-export")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The time it prints is the command's, start-up included (importing torch is seconds): the
    # time from the start to the line, give or take its rounding to whole seconds and the process
    # start time's own error (psutil adds it to the boot time, which Linux gives in whole seconds,
    # so it reads up to a second early). Not the time to the process's exit, which a loaded
    # machine stretches after the line.
    at, printed = next((t, float(m.group(1))) for t, line in lines if (m := re.match(r"^\((\d+) s\)$", line.strip())))
    assert at - 1.5 <= printed <= at + 2.0, (printed, at)
    actual = next(line.split(": ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("Run directory: "))
    analysed = _diag("analyze", actual, "--json")
    assert analysed.returncode == 0, analysed.stderr[-2000:]
    return proc.stdout, actual, json.loads(analysed.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("bottleneck", BOTTLENECKS)
def test_demo_verdict_matches_the_induced_bottleneck(bottleneck, tmp_path):
    expected = "compute" if bottleneck == "none" else bottleneck
    run_dir = tmp_path / "demo"
    if bottleneck == "none":
        # An earlier run in the requested folder is kept; the demo goes to demo-2.
        run_dir.mkdir()
        (run_dir / "keep.txt").write_text("earlier run")
    out, actual, doc = _run_demo(bottleneck, run_dir)
    assert actual == str(run_dir if bottleneck != "none" else tmp_path / "demo-2")
    # The printed verdict is the diagnosis's headline, word for word.
    assert f"Verdict: {doc['diagnosis']['headline']['text']}" in out, out
    assert f"Verdict: {expected.capitalize()}-bound" in out, out
    if bottleneck == "none":
        assert (run_dir / "keep.txt").read_text() == "earlier run"

    summary = [(r["rank"], r["bound"], r.get("shares"), [s["bound"] for s in r["steps"]]) for r in doc["ranks"]]
    assert doc["schema"] == "diag.analysis/1"
    assert doc["job"]["bound"] == expected, (summary, doc["job"].get("findings"))
    # Every rank, too: a rank that waits for a briefly slower peer is not comm-bound for it
    # (its wait is its own class, and a long wait takes the peer's verdict).
    assert [r["bound"] for r in doc["ranks"]] == [expected] * len(doc["ranks"]), summary
    assert all(r["wait_split"]["measured"] for r in doc["ranks"]), summary
    for r in doc["ranks"]:
        assert [s["step"] for s in r["steps"]] == list(range(STEPS)), summary
        evidence = {s["evidence"] for s in r["steps"]}
        assert evidence == {"trace", "sampled"}, (summary, doc["errors"])
        assert r["evidence"]["windows"] and r["evidence"]["windows"][0]["first_step"] == (
            schedule(STEPS)["skip_first"] + schedule(STEPS)["warmup"])
    if bottleneck == "none":
        assert _unexplained_warnings(doc) == [], _warnings(doc)
    _assert_causes(bottleneck, doc, Path(actual))
    _assert_causes_reported(Path(actual), doc["diagnosis"]["causes"])
    report = os.path.join(actual, "report.html")
    assert os.path.exists(report), os.listdir(actual)
    assert f"Report: {report}" in out
    _assert_one_set_of_numbers(json.loads(Path(actual, "summary.json").read_text())["diagnosis"], doc)
    _assert_facts_only(Path(actual))


def _assert_facts_only(run_dir: Path) -> None:
    """The run directory holds what was measured: no step record or window summary carries a
    verdict (bound, path) or a judgement (findings)."""
    rd = rundir.RunDir(run_dir)
    for rank in rd.ranks():
        steps, windows = list(rd.records(rank, "steps")), rd.windows(rank)
        assert steps and windows
        assert not [s["step"] for s in steps if {"bound", "path"} & set(s)]
        assert not [w.first_step for w in windows
                    if {"bound", "path", "findings", "title", "fixes"} & set(w.analysis or {})]


def _assert_causes(bottleneck: str, doc: dict, run_dir: Path) -> None:
    """The data demo's DataLoader (agent/demo.py: SlowStorage, num_workers=0), the host demo's
    per-element .item() loop, the memory demo's elementwise layers and the comm demo's all-reduce
    of its embedding table's dense gradient are named as causes, first among their phase's
    actions, each with a gain predicted by replaying the steps without it."""
    diagnosis = doc["diagnosis"]
    found = {c["id"]: c for c in diagnosis["causes"]}
    expected = {"data": "data_loader_no_workers", "host": "host_sync_points", "comm": "exposed_collectives",
                "memory": "elementwise_chain", "compute": "matrix_ops", "none": "matrix_ops"}[bottleneck]
    # Other causes only for a phase that matters (the comm demo's dense embedding gradient is
    # half its step in elementwise ops).
    shares = diagnosis["phase_shares"]
    for c in found.values():
        assert c["id"] == expected or (c["phase"] != diagnosis["bound"] and shares[c["phase"]] >= 0.10), found
    cause = found[expected]
    # The bounding phase's cause comes first, with the gain its own change predicts.
    assert diagnosis["causes"][0]["id"] == expected
    assert cause["evidence"]["ranks"] == [0, 1]
    cpu = json.loads((run_dir / "rank-00000" / "rank.json").read_text())["cpu"]
    if expected == "matrix_ops" and cpu["bf16_units"] is False:
        # fp32 matrix math on a CPU without bf16 units: no precision change to replay, and said so.
        assert cause["what_if"] is None and f"This CPU ({cpu['isa']}) has no bf16 matrix units" in cause["action"]
    elif expected == "exposed_collectives":
        # On gloo no compression hook pays (bf16 needs NCCL, fp16 reduces in software): none is
        # replayed or advised, and the demo's one micro-batch a step leaves no no_sync() to replay.
        assert cause["what_if"] is None and cause["evidence"]["backend"] == "gloo"
        assert "compress_hook(" not in cause["action"] and cause["evidence"]["micro_batches"] is None
    else:
        assert cause["what_if"]["change"] == {"data": "no_data_wait", "host": "no_sync_points",
                                              "memory": "fuse_elementwise_chain",
                                              "compute": "half_precision_matrix_ops",
                                              "none": "half_precision_matrix_ops"}[bottleneck]
        assert 0 < cause["what_if"]["predicted_step_ms"] < cause["what_if"]["baseline_step_ms"]
    if expected == "matrix_ops":
        # agent/demo.py: the compute demo's Linear(1024, 512) on a batch of 1024, the healthy one's
        # Linear(512, 512) on a batch of 2048; each group its forward (aten::linear) or a gradient (aten::mm).
        groups = {(g["op"], g["shapes"]) for g in cause["evidence"]["groups"]}
        layer = ("aten::linear", "1024x1024, 512x1024, 512") if bottleneck == "compute" else \
            ("aten::linear", "2048x512, 512x512, 512")
        assert layer in groups and all(g["dtype"] == "fp32" for g in cause["evidence"]["groups"]), groups
        assert all(op in ("aten::linear", "aten::mm", "aten::addmm") for op, _ in groups), groups
        assert cause["evidence"]["ms_per_step"] >= 0.3 * cause["evidence"]["compute_ms_per_step"]
    elif bottleneck == "data":
        assert cause["evidence"]["loader"]["num_workers"] == 0
        assert cause["evidence"]["loader"]["dataset"] == "SlowStorage"
        assert "DataLoader over SlowStorage has num_workers=0 on ranks 0, 1" in cause["text"]
    elif bottleneck == "memory":
        # agent/demo.py, Elementwise.forward: x * scale + shift, gelu, then x - mean, in each of 6 layers,
        # with no matrix math anywhere in the step.
        ev = cause["evidence"]
        assert ev["ops"][:5] == ["aten::mul", "aten::add", "aten::gelu", "aten::mean", "aten::sub"]
        assert ev["length"] >= 5 * 6 and ev["per_step"] == 1
        # With no matrix math to break it, the one chain holds most of the step's memory time. Its
        # time per step is its total over the rank's traced steps by their count: a share of their
        # mean (their median, the evidence's step_ms, strays from it when a busy machine stalls a few).
        traced = [s["duration_ms"] for r in doc["ranks"] if r["rank"] == ev["ranks"][0]
                  for s in r["steps"] if s["evidence"] == "trace"]
        assert ev["ms_per_step"] >= 0.5 * shares["memory"] * sum(traced) / len(traced)
        assert "torch.compile" in cause["action"]
    elif bottleneck == "comm":
        # DDP all-reduces every gradient once per step; the model facts the agent recorded say how many bytes.
        model = json.loads((run_dir / "rank-00000" / "rank.json").read_text())["model"]
        ev = cause["evidence"]
        assert ev["name"] == "all_reduce" and ev["calls_per_step"] == 1 and ev["median_bytes"] == model["grad_bytes"]
        assert ev["dominant_param"]["name"] == "table.weight"  # nn.Embedding(1 << 18, 32): 8,388,608 of the weights
        assert ev["dominant_param"]["elements"] == 1 << 23 and "sparse=True" in cause["action"]
    else:
        # The demo's loop calls .item() twice per element of its output (agent/demo.py, _host_step).
        (op,) = cause["evidence"]["ops"]
        assert op["name"] == "aten::item" and cause["evidence"]["per_step"] == 768
        assert "aten::item 768 times" in cause["text"] and "per-element .item()" in cause["action"]
        # The first window recorded Python stacks: the call site is the demo's own step function,
        # diag/demo.py in a wheel, agent/demo.py in this checkout.
        (site,) = cause["evidence"]["call_sites"]
        assert site["function"] == "_host_step" and site["file"].endswith("demo.py")
        assert f"in _host_step ({site['file']}:{site['line']})" in cause["action"]
    rec = next(r for r in diagnosis["recommendations"] if r["id"] == f"phase-{diagnosis['bound']}")
    assert rec["causes"] == [expected] and rec["actions"][0] == cause["action"]
    assert not any(a.startswith(tuple(cause["supersedes"])) for a in rec["actions"])


def _assert_causes_reported(run_dir: Path, causes: list[dict]) -> None:
    """The reports say each cause and its change where the verdict is, before the ranked list."""
    from diag.report.markdown import md_text

    md, page = (run_dir / "report.md").read_text(), (run_dir / "report.html").read_text()
    assert ("## Causes found" in md) is bool(causes)
    for c in causes:
        assert md.index(md_text(c["text"])) < md.index("## What to change")
        assert f"Change: {md_text(c['action'])}" in md
        assert html.escape(c["action"], quote=True) in page
    if causes:
        assert page.index("Causes found:") < page.index("Change this first:")


def _assert_one_set_of_numbers(summary: dict, doc: dict) -> None:
    """The report's headline, decision path and phase table quote one measurement set,
    the one `diag analyze --json` gives the verdict on, over the steps it names."""
    bound = summary["bound"]
    assert bound == doc["job"]["bound"]
    shares = summary["phase_shares"]
    assert summary["headline"]["share"] == pytest.approx(shares[bound], abs=1e-12)
    assert f"{round(shares[bound] * 100)}% of step time" in summary["headline"]["text"]
    share_nodes = [n for n in summary["decision_path"]["nodes"] if n["metric"].endswith("_share")]
    assert share_nodes
    for node in share_nodes:
        phase = node["metric"][: -len("_share")]
        # busy_share is derived: a collective waiting for a peer occupies the device as its transfer does.
        expected = shares[phase] if phase in shares else sum(shares[p] for p in ("comm", "wait", "memory", "compute"))
        assert node["value"] == pytest.approx(expected, abs=1e-9), (node, shares)
    basis = doc["job"]["measurements"]["basis"]
    assert summary["decision_path"]["source"] == summary["headline"]["basis"] == basis
    assert summary["measurements"]["values"] == pytest.approx(doc["job"]["measurements"]["values"])


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT"])
def test_demo_linger_serves_the_finished_run_until_stopped(tmp_path, how):
    """After training and the report, the ranks' endpoints keep serving the final values;
    a signal to the demo ends the linger at once, cleanly."""
    import signal
    import threading
    import urllib.request

    base = free_port_pair()
    env = dict(os.environ, DIAG_EXPORTER_BIND="127.0.0.1")
    env.pop("DIAG_EXPORTER", None)
    # SIGINT: Ctrl-C at a terminal, whatever the test runner's own disposition (a runner started
    # in the background ignores SIGINT, and its children inherit that). SIGTERM: a scheduler
    # stopping a demo started under nohup, with SIGINT ignored; the demo still stops its ranks.
    proc = subprocess.Popen([sys.executable, "-m", "diag", "demo", "--steps", "8", "--linger", "300",
                             "--port-base", str(base), "--run-dir", str(tmp_path / "run")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True,
                            preexec_fn=_ignore_sigint if how == "SIGTERM" else _default_sigint)
    out, err = [], []
    readers = [threading.Thread(target=lambda s=s, buf=buf: buf.extend(s), daemon=True)
               for s, buf in ((proc.stdout, out), (proc.stderr, err))]
    for t in readers:
        t.start()
    try:
        wait_for_line(err, "Serving Prometheus metrics", proc)
        # The verdict and the report are out before the linger starts.
        assert any(line.startswith("Verdict: ") for line in out), "".join(out)
        assert (tmp_path / "run" / "report.html").exists()
        for port in (base, base + 1):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                text = r.read().decode()
            steps = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith("diag_steps_total{")]
            assert steps == [8.0], steps
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM if how == "SIGTERM" else signal.SIGINT)  # the demo only, not its ranks
        try:  # longer than the demo's own bound on stopping its ranks (30 s), so that its stderr says why
            rc = proc.wait(45)
        except subprocess.TimeoutExpired:
            rc = None
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    for t in readers:
        t.join(5)
    assert rc == 0 and took < 25, (rc, took, "".join(err)[-3000:])
    assert "Traceback" not in "".join(err), "".join(err)[-3000:]
    for port in (base, base + 1):  # the ranks are gone with their endpoints
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def _default_sigint() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _ignore_sigint() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _sleeper(ignore_sigint: bool, ready) -> None:
    import signal

    # A demo rank takes SIGINT, whatever it inherited; this one may be told to ignore it.
    signal.signal(signal.SIGINT, signal.SIG_IGN if ignore_sigint else signal.default_int_handler)
    ready.set()
    try:
        time.sleep(60)
    except KeyboardInterrupt:
        pass


def test_a_rank_that_ignores_the_stop_is_killed_and_named(capsys):
    """Stopping the demo's ranks is bounded: a rank still alive after the bound is killed, and
    the demo says which; a rank that stops on SIGINT is not mentioned."""
    import multiprocessing as mp
    from types import SimpleNamespace

    from diag.demo import _stop_ranks

    ctx = mp.get_context("fork")
    ready = [ctx.Event(), ctx.Event()]
    procs = [ctx.Process(target=_sleeper, args=(ignore, ev)) for ignore, ev in zip((False, True), ready)]
    for p in procs:
        p.start()
    for ev in ready:
        assert ev.wait(10)
    t0 = time.monotonic()
    _stop_ranks(SimpleNamespace(processes=procs), timeout_s=1.0)
    assert time.monotonic() - t0 < 8
    assert not any(p.is_alive() for p in procs)
    assert procs[0].exitcode == 0 and procs[1].exitcode == -9
    err = capsys.readouterr().err
    assert "rank 1 did not stop within 1 s of SIGINT; killing it" in err
    assert "rank 0" not in err
