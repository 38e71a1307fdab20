"""The code base stays clean under the project's ruff configuration."""

import ast
import subprocess

import pytest
from conftest import REPO, require_executable


def test_ruff_clean():
    ruff = require_executable("ruff", "pip install -e '.[test]'")
    proc = subprocess.run([ruff, "check", "--no-cache", str(REPO)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# What each part of the package may import from diag, as ARCHITECTURE.md states it. A module
# is allowed an import when the imported module equals, or lies inside, one of its entries.
_ANALYZERS = "diag.analyzers"
# The run directory: its layout, its files written whole and read within bounds, its record streams.
RUN_DIR = ("diag.rundir", "diag.atomic_io", "diag.segments", "diag.step_record", "diag.run_documents",
           "diag.typed_json", "diag.diagnosis_document")
# The typed documents: the run directory's records (the diagnosis and the views read them)
# and the diagnosis (the diagnosis makes it, the views read it).
RUN_DOCUMENTS = ("diag.step_record", "diag.run_documents", "diag.diagnosis_document", "diag.typed_json")
LAYERS = {
    "analyzers/intervals.py": (),
    "analyzers/analysis_types.py": ("diag.typed_json", "diag.diagnosis_document"),
    # The core every layer reads numbers through.
    "analyzers/numbers.py": (),
    # Bytes per element of every dtype spelling the inputs use.
    "analyzers/dtypes.py": (),
    # The names every stage shares (classes, measurements, the analysis's settings).
    "analyzers/model.py": (),
    # The analysis (facts) never imports the diagnosis (judgement).
    "analyzers/trace": ("diag.errors", "diag.inflate", *RUN_DIR, f"{_ANALYZERS}.analysis_types", f"{_ANALYZERS}.numbers",
                        f"{_ANALYZERS}.dtypes",
                        f"{_ANALYZERS}.intervals", f"{_ANALYZERS}.model", f"{_ANALYZERS}.trace",
                        f"{_ANALYZERS}.whatif.rank"),
    "analyzers/whatif": ("diag.errors", f"{_ANALYZERS}.intervals", f"{_ANALYZERS}.trace.event_classes", f"{_ANALYZERS}.analysis_types",
                         f"{_ANALYZERS}.whatif", f"{_ANALYZERS}.numbers"),
    "analyzers/nccl": ("diag.errors", "diag.inflate", f"{_ANALYZERS}.nccl", f"{_ANALYZERS}.dtypes"),
    "analyzers/job": ("diag.errors", f"{_ANALYZERS}.numbers", *RUN_DIR, f"{_ANALYZERS}.analysis_types",
                      f"{_ANALYZERS}.intervals", f"{_ANALYZERS}.model", f"{_ANALYZERS}.trace", f"{_ANALYZERS}.job",
                      f"{_ANALYZERS}.whatif", "diag.collectors.nccl_sizes"),
    "analyzers/diagnosis": ("diag.errors", f"{_ANALYZERS}.numbers", f"{_ANALYZERS}.model", f"{_ANALYZERS}.analysis_types",
                            f"{_ANALYZERS}.diagnosis", f"{_ANALYZERS}.plan.memory", *RUN_DOCUMENTS),
    "analyzers/plan": ("diag.errors", f"{_ANALYZERS}.numbers", f"{_ANALYZERS}.plan", f"{_ANALYZERS}.trace.devices",
                       f"{_ANALYZERS}.nccl.expected"),
    "analyzers/views": ("diag.errors", f"{_ANALYZERS}.diagnosis", f"{_ANALYZERS}.views", f"{_ANALYZERS}.analysis_types",
                        f"{_ANALYZERS}.job.cross_rank", f"{_ANALYZERS}.numbers", *RUN_DOCUMENTS),
    "analyzers/analyze.py": ("diag.errors", *RUN_DIR, _ANALYZERS),
    "analyzers/run_records.py": ("diag.errors", *RUN_DIR, f"{_ANALYZERS}.nccl", f"{_ANALYZERS}.analysis_types"),
    "collectors": ("diag.collectors", *RUN_DIR, "diag.__version__"),
    # agent/, the package `diag` itself. Leaves every side imports without a cycle (the package's
    # __init__ resolves its attributes lazily):
    "agent/rundir.py": ("diag.atomic_io", "diag.segments", "diag.step_record", "diag.run_documents"),
    "agent/step_record.py": ("diag.typed_json",),
    "agent/run_documents.py": ("diag.step_record", "diag.typed_json"),
    "agent/typed_json.py": (),
    "agent/diagnosis_document.py": ("diag.typed_json",),
    "agent/atomic_io.py": (),
    "agent/segments.py": ("diag.atomic_io",),
    "agent/errors.py": (),
    "agent/inflate.py": ("diag.errors",),
    "agent/__init__.py": (),
    # The views render the diagnosis: they read the facade's document, never a trace or a log.
    "agent/report": ("diag.__version__", "diag.errors", *RUN_DIR, "diag.report", f"{_ANALYZERS}.analyze",
                     f"{_ANALYZERS}.analysis_types", f"{_ANALYZERS}.views", f"{_ANALYZERS}.diagnosis",
                     f"{_ANALYZERS}.numbers"),
    "agent/exporter": ("diag.__version__", f"{_ANALYZERS}.numbers", "diag.exporter", f"{_ANALYZERS}.diagnosis",
                       "diag.step_record", "diag.diagnosis_document"),
    # diag top: reads live.json or the endpoints into the live facts, draws the live judgement.
    "agent/top": ("diag.errors", *RUN_DIR, "diag.report", "diag.top", f"{_ANALYZERS}.job.live",
                  f"{_ANALYZERS}.diagnosis.live"),
    # In the training process: the agent and its parts, the collectors, and the tree for the live verdicts.
    "agent/agent.py": ("diag.collectors", "diag.config", "diag.errors", *RUN_DIR, "diag.background",
                       "diag.job_finish", "diag.job_inputs", "diag.live_feed", "diag.on_demand", "diag.supervisor",
                       "diag.termination"),
    "agent/supervisor.py": ("diag.calibrate", "diag.collectors", "diag.exporter", "diag.nccl_watch", *RUN_DIR,
                            "diag.window_analysis", f"{_ANALYZERS}.trace.devices"),
    "agent/background.py": ("diag.collectors", "diag.step_record"),
    "agent/live_feed.py": ("diag.collectors", "diag.live_verdict", "diag.step_record",
                           f"{_ANALYZERS}.diagnosis.decision_tree"),
    "agent/job_finish.py": (*RUN_DIR, "diag.report"),
    "agent/job_inputs.py": ("diag.batches", "diag.collectors", *RUN_DIR),
    "agent/on_demand.py": ("diag.exporter",),
    "agent/termination.py": (),
    # The live views' verdicts: the diagnosis's own functions over the facts as they come.
    "agent/live_verdict.py": (f"{_ANALYZERS}.job.sampled", f"{_ANALYZERS}.diagnosis.decision_tree",
                              f"{_ANALYZERS}.diagnosis.rank", f"{_ANALYZERS}.analysis_types", "diag.step_record"),
    # diag nccl: its output (the judgement of each test is the diagnosis's) and its measuring mode.
    "agent/nccl_output.py": ("diag.errors", *RUN_DIR, f"{_ANALYZERS}.diagnosis", f"{_ANALYZERS}.nccl"),
    "agent/nccl_measure.py": ("diag.errors", *RUN_DIR, "diag.nccl_output", "diag.nccl_table", "diag.collectors",
                              f"{_ANALYZERS}.nccl"),
    "agent/nccl_watch.py": (*RUN_DIR, f"{_ANALYZERS}.nccl.log"),
    "agent/window_analysis.py": (*RUN_DIR,),
    # A window's facts only: the run directory holds no verdict.
    "agent/window_worker.py": (*RUN_DIR, f"{_ANALYZERS}.diagnosis.decision_tree", f"{_ANALYZERS}.trace.analysis",
                               f"{_ANALYZERS}.analysis_types"),
    "agent/config.py": ("diag.errors", "diag.collectors", f"{_ANALYZERS}.diagnosis.decision_tree"),
    "agent/calibrate.py": (*RUN_DIR, f"{_ANALYZERS}.trace.devices"),
    "agent/integrations.py": ("diag.agent", "diag.trackers"),
    "agent/trackers.py": (f"{_ANALYZERS}.numbers",),
    "agent/batches.py": (),
    "agent/ray_pool.py": ("diag.errors",),
    "agent/nccl_table.py": ("diag.errors",),
    "agent/cli.py": ("diag.__version__", "diag.errors"),
    "agent/__main__.py": ("diag.cli",),
    # The demo trains under the agent and reads the report it wrote; the commands tie every part together.
    "agent/demo.py": ("diag",),
    "agent/commands": ("diag",),
}


def _diag_imports(path):
    """Every diag module a file imports, as dotted names (`from diag import rundir` -> diag.rundir)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "diag"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "diag":
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def _allowed(name: str, entries) -> bool:
    return any(name == e or name.startswith(e + ".") for e in entries)


@pytest.mark.parametrize("part", sorted(LAYERS))
def test_layering(part):
    """Each package imports only what it may: data flows collectors -> run directory ->
    analysis -> diagnosis -> views, and analyzers and collectors never import each other."""
    root = REPO / part
    files = [root] if root.suffix == ".py" else sorted(root.rglob("*.py"))
    assert files, part
    bad = []
    for path in files:
        for line, name in _diag_imports(path):
            if not _allowed(name, LAYERS[part]):
                bad.append(f"{path.relative_to(REPO)}:{line} imports {name}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("folder", ["analyzers", "agent"])
def test_every_module_has_a_layer(folder):
    covered = [REPO / p for p in LAYERS]
    for path in (REPO / folder).rglob("*.py"):
        if path.name == "__init__.py" and path.parent == REPO / "analyzers":
            continue
        assert any(path == c or c in path.parents for c in covered), f"{path.relative_to(REPO)} has no layer"


# The judgements of the diagnosis layer, by the names that make them (ARCHITECTURE.md, "Judgements").
JUDGEMENT_CALLS = {"evaluate", "verdict_from", "advise", "Walker", "walk", "walk_one", "judge", "judge_trace",
                   "judge_run_rank", "sampled_verdicts", "resolve", "own_work", "straggler_what_if", "likely_cause",
                   "step_time_change", "scaling_rating", "with_likely_causes", "judge_live"}


def test_judgements_are_made_in_the_diagnosis_layer():
    """No module of the analysis side (trace, job, nccl, whatif) calls a judgement of the diagnosis
    layer, and none holds a threshold table of its own (the tree's [thresholds] are the one table)."""
    callers = set()
    for path in list((REPO / "analyzers").rglob("*.py")) + list((REPO / "agent").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith("analyzers/diagnosis/"):
            continue
        tree = ast.parse(path.read_text())
        imported = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                    and (n.module or "").startswith("diag.analyzers.diagnosis") for a in n.names}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in (
                    "dt", "decision_tree", "stragglers", "bandwidth", "change", "peers") else f.id if isinstance(
                    f, ast.Name) and f.id in imported else None
                # The tree's Walker, however it is reached (tree.walker.walk).
                if name in JUDGEMENT_CALLS or isinstance(f, ast.Attribute) and f.attr in ("walk", "walk_one"):
                    callers.add(rel)
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in ("DEFAULTS", "THRESHOLDS")
                                                    for t in node.targets):
                callers.add(f"{rel} (a threshold table)")
    # The analysis (facts) side; views and commands may ask the diagnosis for a judgement it makes.
    analysis_side = {c for c in callers if c.startswith(("analyzers/trace/", "analyzers/job/", "analyzers/nccl/",
                                                         "analyzers/whatif/"))}
    assert not analysis_side, analysis_side


def test_the_analysis_writes_no_finding():
    """Facts, then one judgement: no module of the trace, job, NCCL or what-if analysis writes
    a finding (a severity or advice); the diagnosis makes them from the facts."""
    judged_keys = {"severity", "advice"}
    found = []
    for folder in ("trace", "job", "nccl", "whatif"):
        for path in sorted((REPO / "analyzers" / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                keys = [k.value for k in node.keys if isinstance(k, ast.Constant)] if isinstance(node, ast.Dict) else []
                keys += [k.arg for k in node.keywords] if isinstance(node, ast.Call) else []
                if judged_keys & set(keys):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, found


def _diagnosis_calls_into_the_analysis(run) -> dict:
    """Every call a function of analyzers/diagnosis/ makes into a function of the analysis
    (trace/, job/, whatif/, nccl/) or the views while `run()` runs: (caller, callee) -> count."""
    import sys

    root = (REPO / "analyzers").resolve()
    diagnosis = str(root / "diagnosis") + "/"
    others = tuple(str(root / p) + "/" for p in ("trace", "job", "whatif", "nccl", "views"))
    calls: dict = {}

    def watch(frame, event, arg):
        if event != "call" or frame.f_back is None:
            return
        callee, caller = frame.f_code.co_filename, frame.f_back.f_code.co_filename
        if caller.startswith(diagnosis) and callee.startswith(others):
            key = (f"{caller[len(str(root)) + 1:]}:{frame.f_back.f_code.co_name}",
                   f"{callee[len(str(root)) + 1:]}:{frame.f_code.co_name}")
            calls[key] = calls.get(key, 0) + 1

    sys.setprofile(watch)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


def test_the_diagnosis_calls_nothing_of_the_analysis_at_run_time(real_traces, demo_run_dir):
    """Facts, then one judgement, proven by a call trace (imports alone could be passed by an
    object that carries the analysis's code): judging two ranks' real traces, matched across
    ranks, and a real run directory with its sampled steps, no diagnosis function calls into
    the analysis or the views."""
    from diag.analyzers.analyze import analyze_paths, analyze_run_dir

    pair = [str(real_traces / f"job128_rank{r}_sampled.json.gz") for r in (0, 1)]
    docs = []
    calls = _diagnosis_calls_into_the_analysis(lambda: docs.append(analyze_paths(pair, jobs=1)))
    calls |= _diagnosis_calls_into_the_analysis(lambda: docs.append(analyze_run_dir(demo_run_dir)))
    assert not calls, calls
    # The trace was live: the judgement ran (stragglers over matched collectives, sampled steps).
    assert docs[0].job.rank_waits and docs[1].diagnosis.bound
    assert any(s.get("evidence") == "sampled" for r in docs[1].ranks for s in r.facts.steps)


MAX_FUNCTION_LINES = 80


def test_no_function_is_over_80_lines():
    """A function says one thing: none in the package is longer than MAX_FUNCTION_LINES."""
    long = []
    for folder in ("agent", "analyzers", "collectors"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


MAX_MODULE_LINES = 600
MAX_CLASS_METHODS = 25


def test_modules_and_classes_stay_small():
    """No module over MAX_MODULE_LINES lines, and no class over MAX_CLASS_METHODS methods."""
    over = []
    for folder in ("agent", "analyzers", "collectors"):
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            text = path.read_text()
            lines = text.count("\n")
            if lines > MAX_MODULE_LINES:
                over.append(f"{rel}: {lines} lines")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.ClassDef):
                    n = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)
                    if n > MAX_CLASS_METHODS:
                        over.append(f"{rel}:{node.name}: {n} methods")
    assert not over, over
