"""report.html / report.md / summary.json: self-contained, escaped, and written by the CLI."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rank_documents import diagnosed
from report_helpers import analysis_rank, write_run

from diag.analyzers.diagnosis.decision_tree import load_tree
from diag.report import html as report_html
from diag.report import write_report, write_report_from_analysis
from diag.report.progress import Stages, progress_factory

KERNEL = "<img src=x onerror=alert(1)>"
HOST = "<script>alert(2)</script>"


def hostile_doc() -> dict:
    ranks = [analysis_rank(r, 2, "compute", 0.6, kernel_name=KERNEL, host=HOST) for r in range(2)]
    ranks[0]["findings"] = [{"id": "x", "severity": "warning", "message": "log line: " + HOST + "</script><!--",
                             "advice": KERNEL, "evidence": {"line": HOST}}]
    doc = {"schema": "diag.analysis/1", "ranks": ranks,
           "job": {"bound": "compute", "stragglers": [], "findings": [], "world_size": 2}, "errors": []}
    return diagnosed(doc, load_tree())


def test_script_json_cannot_end_the_script_block():
    payload = {"a": "</script><script>alert(1)</script>", "b": "<!-- x -->", "c": "&amp; \u2028"}
    text = report_html.script_json(payload)
    assert "<" not in text and ">" not in text and "&" not in text and "\u2028" not in text
    assert json.loads(text) == payload


def test_untrusted_names_are_text_in_html_and_markdown(tmp_path):
    paths = write_report_from_analysis(hostile_doc(), tmp_path)
    page = Path(paths["html"]).read_text(encoding="utf-8")
    # The hostile strings appear only escaped.
    assert KERNEL not in page and HOST not in page
    assert "&lt;img src=x onerror=alert(1)&gt;" in page
    assert "&lt;script&gt;alert(2)&lt;/script&gt;" in page
    # Every <script> element is one the page itself opened: no extra opening tag got in.
    body = page.split("</head>", 1)[1]
    assert body.count("<script") == body.count("</script>") == 3
    for block in ("diag-data", "diag-diagnosis"):
        data = re.search(rf'<script type="application/json" id="{block}">(.*?)</script>', page, re.S).group(1)
        assert "<" not in data and "-->" not in data
    md = Path(paths["markdown"]).read_text(encoding="utf-8")
    assert "`<img src=x onerror=alert(1)>`" in md  # in a code span, shown literally
    outside_code = re.sub(r"(`+).*?\1", "", md)
    assert "<img" not in outside_code and "<script" not in outside_code
    summary = json.loads(Path(paths["summary"]).read_text())
    assert summary["top_kernels"][0]["name"] == KERNEL  # JSON keeps the real name


def test_page_is_self_contained_with_plotly_inlined_once(tmp_path):
    run = write_run(tmp_path / "run", ranks=2, steps=30, bound="comm", gpu=True)
    paths = write_report(run)
    page = Path(paths["html"]).read_text(encoding="utf-8")
    # Nothing is fetched from elsewhere: no script/link/img pointing to a URL.
    assert not re.search(r"<(script|link|img|iframe)[^>]+(src|href)=", page)
    js = report_html.plotly_js()
    assert page.count(js) == 1  # the whole library, once
    # The page's own script draws every figure through one Plotly.newPlot call.
    assert page.replace(js, "").count("Plotly.newPlot(") == 1
    figs = json.loads(re.search(r'id="diag-data">(.*?)</script>', page, re.S).group(1))["figures"]
    ids = {f["id"] for f in figs}
    assert {"fig-phases", "fig-throughput", "fig-heat-step", "fig-tl-gpu_util", "fig-tl-gpu_clock"} <= ids
    for fid in ids:  # every figure has a div to draw into
        assert f'id="{fid}"' in page
    # The five questions a reader has are answered in plain words on the page.
    for heading in ("What bounds the training", "How sure we are", "Change this first", "What to change, in order",
                    "Why we think so", "What was missing, and how to get it"):
        assert heading in page


def test_report_command_writes_three_files_and_prints_the_verdict(tmp_path):
    run = write_run(tmp_path / "run", ranks=2, steps=30, bound="data", strength=0.4)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "diag", "report", str(run), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Data-bound: waiting for the DataLoader takes 40% of step time")
    assert "Change first: Feed the device faster" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["report.html", "report.md", "summary.json"]
    assert proc.stderr == ""  # not a terminal: no progress bar
    summary = json.loads(Path(out / "summary.json").read_text())
    assert summary["schema"] == "diag.report_summary/2" and summary["diagnosis"]["bound"] == "data"


def test_report_command_on_bad_input_is_one_line_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "diag", "report", str(tmp_path / "missing")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("diag: error: ") and proc.stderr.count("\n") == 1
    assert "Traceback" not in proc.stderr


def test_threshold_override_changes_the_verdict(tmp_path):
    run = write_run(tmp_path / "run", ranks=1, steps=20, bound="data", strength=0.3, windows=False)
    out = tmp_path / "o"
    proc = subprocess.run([sys.executable, "-m", "diag", "report", str(run), "--out", str(out),
                           "--threshold", "data_wait=0.5", "--quiet"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    summary = json.loads(Path(out / "summary.json").read_text())
    assert summary["diagnosis"]["decision_path"]["nodes"][0]["threshold"] == 0.5
    assert summary["diagnosis"]["bound"] != "data"


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_only_on_a_terminal():
    assert progress_factory(io.StringIO()) is None
    tty = _Tty()
    bar = progress_factory(tty)
    assert list(bar(range(3), desc="reading ranks")) == [0, 1, 2]
    assert "reading ranks" in tty.getvalue()
    stages = Stages(["analysing the run", "writing the files"], stream=tty)
    stages.advance("analysing the run")
    stages.advance("writing the files")
    stages.close()
    assert "writing the files:  50%" in tty.getvalue()
    quiet = io.StringIO()
    stages = Stages(["analysing the run"], stream=quiet)
    stages.advance("analysing the run")
    stages.close()
    assert quiet.getvalue() == ""


def test_a_cause_quoting_hostile_op_names_stays_text(tmp_path):
    """A memory-bound trace whose elementwise chain is named by hostile op names: the cause
    quotes them, and the page and the Markdown show them as text."""
    ranks = [analysis_rank(r, 2, "memory", 0.7, kernel_name=KERNEL) for r in range(2)]
    for r in ranks:
        r["elementwise_chains"] = [{"name": f"{KERNEL} → {HOST} → aten::mul", "ops": [KERNEL, HOST, "aten::mul"],
                                    "length": 3, "per_step": 1.0, "ms_per_step": 30.0}]
    doc = diagnosed({"schema": "diag.analysis/1", "ranks": ranks, "errors": [],
                          "job": {"bound": "memory", "stragglers": [], "findings": [], "world_size": 2}}, load_tree())
    (cause,) = [c for c in doc.diagnosis.causes if c["id"] == "elementwise_chain"]
    assert KERNEL in cause["text"] and HOST in cause["text"]  # the diagnosis keeps the real names
    paths = write_report_from_analysis(doc, tmp_path)
    page = Path(paths["html"]).read_text(encoding="utf-8")
    assert KERNEL not in page and HOST not in page and "Causes found:" in page
    assert "&lt;img src=x onerror=alert(1)&gt;" in page
    md = Path(paths["markdown"]).read_text(encoding="utf-8")
    assert "## Causes found" in md
    outside_code = re.sub(r"(`+).*?\1", "", md)
    assert "<img" not in outside_code and "<script" not in outside_code


@pytest.mark.parametrize("text,shown", [
    ("Memcpy HtoD (Pageable -> Device)", "Memcpy HtoD (Pageable -> Device)"),  # an arrow is text
    ("<img src=x onerror=alert(1)>", "&lt;img src=x onerror=alert(1)>"),  # no tag can open
    ("AT&T", "AT&amp;T"),
    ("> not a quote", "\\> not a quote"),
    ("a | b [link](x)", "a \\| b \\[link\\](x)"),
])
def test_markdown_text_is_escaped_only_where_markdown_would_act(text, shown):
    from diag.report.markdown import md_text

    assert md_text(text) == shown
