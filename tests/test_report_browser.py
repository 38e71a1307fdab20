"""The report in a real headless Chromium: charts drawn, no console errors, nothing injected.

The page under test is the report a real `diag.Agent` run wrote at its exit (a small CPU
training loop with a torch.profiler window, analysed by the real analyzers). The browser
is driven over the DevTools protocol (see report_helpers.Browser for why); screenshots are
saved to tests/artifacts/ for people to look at.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest
from conftest import require_executable
from report_helpers import CHART_STATE_JS, CHARTS_DRAWN_JS, Browser
from test_report_html import HOST, KERNEL, hostile_doc

pytestmark = pytest.mark.slow

AGENT_RUN = textwrap.dedent("""
    import sys, time, torch, diag
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [torch.randn(64, 256) for _ in range(14)]
    with diag.Agent(run_dir=sys.argv[1], skip_first=3, warmup=1, active=3, every=1000, export=False,
                    sample_interval_s=0.1, nccl_log=False, verbose=False) as agent:
        for x in agent.loader(data):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(0.005)
            agent.step(samples=64)
""")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    chromium = require_executable("chromium", "apt-get install chromium")
    pytest.importorskip("websocket", reason="pip install websocket-client (test dependency)")
    b = Browser(chromium, tmp_path_factory.mktemp("chromium-profile"))
    try:
        yield b
    finally:
        b.close()


@pytest.fixture(scope="module")
def agent_report(tmp_path_factory):
    run = tmp_path_factory.mktemp("agent") / "run"
    proc = subprocess.run([sys.executable, "-c", AGENT_RUN, str(run)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    page = run / "report.html"
    assert page.exists(), "the agent did not write its report at exit:\n" + proc.stderr[-2000:]
    return page


def test_real_agent_report_renders_every_chart(browser, agent_report, artifacts_dir):
    figures = json.loads(re.search(r'id="diag-data">(.*?)</script>', agent_report.read_text(), re.S).group(1))
    expected = {f["id"] for f in figures["figures"]}
    # A real run has at least the phase, throughput, heatmap and host-metric charts.
    assert {"fig-phases", "fig-throughput", "fig-heat-step", "fig-tl-host_cpu"} <= expected
    browser.events.clear()
    browser.open(agent_report.as_uri(), CHARTS_DRAWN_JS, timeout=60)
    browser.pump(0.3)
    state = browser.eval(CHART_STATE_JS)
    assert {c["id"] for c in state} == expected
    for c in state:
        assert c["plotly"] and c["svgs"] >= 1, c
        assert c["data"] >= 1 and c["traces"] >= 1, c  # drawn with data, not an empty frame
    assert browser.errors() == []
    assert browser.dialogs() == []
    text = browser.eval("document.body.innerText")
    assert "What bounds the training" in text and "How sure we are" in text
    shot = artifacts_dir / "report_agent_run.png"
    browser.screenshot(shot)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


def test_hostile_names_show_as_text_and_run_nothing(browser, tmp_path, artifacts_dir):
    from diag.report import write_report_from_analysis

    page = write_report_from_analysis(hostile_doc(), tmp_path)["html"]
    browser.events.clear()
    browser.open(f"file://{page}", CHARTS_DRAWN_JS, timeout=60)
    browser.pump(0.5)
    assert browser.dialogs() == []  # no alert() ran
    assert browser.eval("document.querySelector('img[src=\"x\"]') === null")
    assert browser.eval("document.querySelectorAll('img').length") == 0
    # Only the page's own four scripts: plotly, the chart data, the diagnosis and the chart drawing code.
    assert browser.eval("document.scripts.length") == 4
    # The names are in the data blocks, which the browser does not run, and in no script it runs.
    assert browser.eval("Array.from(document.scripts).some(s => s.type !== 'application/json' "
                        "&& s.textContent.includes('alert(2)'))") is False
    text = browser.eval("document.body.innerText")
    assert KERNEL in text and HOST in text
    assert browser.errors() == []
    browser.screenshot(artifacts_dir / "report_escaping.png")


def test_compare_page_renders(browser, tmp_path):
    from report_helpers import write_run

    from diag.analyzers.views.compare_model import compare
    from diag.report import analyse_and_model
    from diag.report.compare import write_compare

    a = write_run(tmp_path / "a", ranks=2, steps=30, bound="data", step_s=0.05, seed=1)
    b = write_run(tmp_path / "b", ranks=4, steps=30, bound="compute", step_s=0.04, seed=2)
    (da, ma), (db, mb) = analyse_and_model(a), analyse_and_model(b)
    page = write_compare(compare(ma, mb, da, db), tmp_path / "cmp")["html"]
    browser.events.clear()
    browser.open(f"file://{page}", CHARTS_DRAWN_JS, timeout=60)
    state = browser.eval(CHART_STATE_JS)
    assert [c["id"] for c in state] == ["fig-compare-phases"] and state[0]["traces"] >= 1
    text = browser.eval("document.body.innerText")
    assert "The change helped" in text and "Scaling efficiency from 2 to 4 ranks" in text
    assert browser.errors() == []


# Markup plotly would draw from its HTML subset (links, bold, italics, breaks, superscripts,
# styled spans), in every name a report or a compare page puts into a chart.
MARKUP = ('<a href="https://example.com/x">k</a><b>bold</b><i>it</i><br><sup>2</sup>'
          '<span style="color:red">red</span>')
MARKUP_ELEMENTS_JS = ("['a', 'b', 'i', 'br', 'sup', 'sub', 'span', 'tspan']"
                      ".map(t => document.querySelectorAll(t).length)")


def _named_run(root, name: str):
    """A run whose kernel, host, run and collective names are `name` (with a nccl bench)."""
    from report_helpers import write_run

    from diag import atomic_io, rundir

    run = write_run(root, ranks=2, steps=30, bound="comm", gpu=True, kernel_name=name, hostname=name)
    manifest = json.loads((run / rundir.MANIFEST).read_text())
    atomic_io.atomic_write_json(run / rundir.MANIFEST, {**manifest, "run": name})
    rows = [{"size_bytes": 1 << k, "out_of_place": {"busbw_gbps": 2.0 * k}} for k in range(10, 24)]
    atomic_io.atomic_write_json(run / rundir.NCCL_BENCH, {"schema": "diag.nccl_bench/1", "tests": [
        {"collective": name, "world_size": 2, "backend": name, "status": "ok", "rows": rows}]})
    return run


def _markup_counts(browser, page, figure_ids=None) -> list:
    browser.events.clear()
    browser.open(f"file://{page}", CHARTS_DRAWN_JS, timeout=60)
    browser.pump(0.3)
    if figure_ids is not None:
        assert figure_ids <= {c["id"] for c in browser.eval(CHART_STATE_JS)}
    assert browser.errors() == []
    return browser.eval(MARKUP_ELEMENTS_JS)


def test_markup_in_names_stays_text_in_the_charts(browser, tmp_path):
    """A report and a compare page whose names carry plotly's markup have exactly the markup
    elements of the same pages with plain names: the charts draw the names as text."""
    from diag.analyzers.views.compare_model import compare
    from diag.report import analyse_and_model, write_report
    from diag.report.compare import write_compare

    counts = {}
    for kind, name in (("plain", "plain_name"), ("hostile", MARKUP)):
        a, b = _named_run(tmp_path / kind / "a", name), _named_run(tmp_path / kind / "b", name)
        report = write_report(a)["html"]
        (da, ma), (db, mb) = analyse_and_model(a), analyse_and_model(b)
        page = write_compare(compare(ma, mb, da, db), tmp_path / kind / "cmp")["html"]
        counts[kind] = [_markup_counts(browser, report, {"fig-busbw"})]
        if kind == "hostile":
            assert "bold" in browser.eval("document.body.innerText")  # the names are on the page, as text
        counts[kind].append(_markup_counts(browser, page, {"fig-compare-phases"}))
    assert counts["hostile"] == counts["plain"]
