"""The parts of the analysis document (schema diag.analysis/1) that pass between the stages,
declared: what the analysis measures (the facts) and what the diagnosis adds (the verdicts).

The facts are msgspec Structs: a rank's (`TraceRankFacts`, `RunRankFacts`, with their
`CauseFacts`), the job block's (`JobFacts`) and the whole job's (`AnalysisFacts`). The judged
forms are Structs too: a rank's facts with its `RankVerdict` (`JudgedRank`), the job block with
its verdict (`Job`), and the document with its diagnosis (`Analysis`). Steps are dicts
declared by TypedDicts. Each stage returns a new value of the next type (`trace_facts` gives a
`TraceRankFacts`, `diagnosis.rank.judge_trace` makes it a `JudgedRank`; `analyze_job` gives a
`JobFacts`, `diagnosis.verdict.job_verdict` makes it a `Job`; `analyze.with_diagnosis` makes an
`AnalysisFacts` and its judged ranks an `Analysis`) and never rewrites its input. JSON is read
and written only at the edges: a window summary holds a `TraceRankFacts` in its document form,
read back by `trace_facts_from_document`; a saved analysis is read back by
`analysis_from_json`, its ranks by `document_ranks`, and a judged rank written by
`rank_document`.
`tests/test_analysis_types.py` checks real outputs against these declarations. Shares are
fractions of the step's wall time; `_us` is microseconds on the trace's clock, `_ms`
milliseconds.

Imports nothing from diag but its typed-JSON reader and the diagnosis document's types: every
layer may read it. (No `from __future__ import annotations`: TypedDict reads NotRequired from
evaluated annotations.)
"""

import re
from typing import Any, NotRequired, TypedDict, TypeVar, cast

import msgspec

from diag.diagnosis_document import Diagnosis, diagnosis_from_json
from diag.typed_json import fits, settled

# Ops that bring a tensor's value to the host (on a GPU each waits for the device to reach it):
# the trace layer measures their time, the diagnosis names them with the calls that make them.
SYNC_OP_NAMES = ("aten::item", "aten::is_nonzero", "aten::nonzero", "aten::equal")
# A host-to-device copy from pageable memory, by its device activity's name ("Memcpy HtoD
# (Pageable -> Device)"): the driver stages it through a buffer while the host call waits.
PAGEABLE_HTOD_RE = re.compile(r"HtoD.*Pageable", re.IGNORECASE)
# A gradient all-reduce as traces name it (gloo:all_reduce, nccl:all_reduce, c10d::allreduce_).
ALL_REDUCE_RE = re.compile(r"all_?reduce", re.IGNORECASE)


class PathNode(TypedDict):
    """One question of the decision tree as it was answered."""
    node: str
    question: str
    metric: str
    value: float | None  # the measurement, in the metric's unit (decision_tree.MEASUREMENTS)
    op: str
    threshold: float
    answer: str  # "yes" | "no" | "unknown"
    forced: NotRequired[str]  # why the answer was set from outside the measurements
    peer: NotRequired[int]  # a peer-wait node: the rank waited for
    peer_bound: NotRequired[str]


class Finding(TypedDict):
    id: str
    severity: str  # "info" | "warning" | "error"
    message: str
    advice: str
    evidence: dict


class _StepWhatIf(TypedDict, total=False):
    """A replayed step (whatif.rank.STEP_KEYS)."""
    critical_path: dict  # class -> ms on the step's critical path
    what_if_ms: dict  # change name -> the step's replayed duration under it, ms
    replayed_ms: float  # the step replayed with no change (equals the measured step within slack)
    present_classes: list[str]


class TraceStepFacts(_StepWhatIf):
    """One step of a trace, as measured."""
    step: int
    start_us: float
    duration_ms: float
    shares: dict[str, float]  # class (decision_tree.CLASSES) -> share of the step
    evidence: str  # "trace" (the diagnosis says "sampled" for a sampled trace)
    measurements: dict[str, float]  # what the tree asks about, by metric name
    flops: float | None  # executed FLOPs of the step's ops


class Verdict(TypedDict):
    bound: str | None  # decision_tree.BOUNDS, "peer" before peers are resolved, None if withheld
    path: list[PathNode]


class TraceStep(TraceStepFacts, Verdict):
    """A trace's step with its verdict."""


class RunStepFacts(_StepWhatIf):
    """One step of a run directory's rank, as measured."""
    step: int
    duration_ms: float | None
    shares: dict[str, float] | None
    evidence: str  # "trace" (inside a profiler window) | "sampled" (always-on measurements)
    data_wait_ms: NotRequired[float | None]
    start_unix: NotRequired[float]  # when the step began (the agent's wall clock)
    device_ms: NotRequired[float]  # device time between the step's timing events
    host_ms: NotRequired[float]  # the host's time for a step the device paced (duration_ms is the device's)
    data_idle_ms: NotRequired[float]  # the device's idle time within the step's data waits
    collate_ms: NotRequired[float]  # of the data wait, collating in the training process (num_workers=0)
    cpu_ms: NotRequired[float]  # the process's CPU time over the step, all its threads
    data_cpu_ms: NotRequired[float]  # of it, during the data wait
    samples: NotRequired[float]
    tokens: NotRequired[float]
    peak_mem_bytes: NotRequired[float]
    mfu: NotRequired[float]


class RunStep(RunStepFacts, Verdict):
    """A run directory's step with its verdict; a sampled step's path is given only where it
    differs from the previous sampled step's."""


class CauseFacts(msgspec.Struct, kw_only=True):
    """What the cause rules read of a rank, per traced step (trace.analysis); a run directory's
    rank holds the same, merged from its profiled windows. Written at the top level of the rank."""
    copies: list[dict] = []  # device copies by kind, per traced step (trace.host_device)
    launches: dict | None = None  # kernel launches per traced step (trace.host_device)
    allocator: list[dict] = []  # cudaMalloc/cudaFree-family calls per traced step (trace.host_device)
    cpu_work: list[dict] = []  # ops of the training thread that run on the CPU, per traced step (trace.host_device)
    python_gaps: dict | None = None  # the training thread's time outside every op, and the frames holding it (trace.python_gaps)
    math: dict | None = None  # matrix kernels' time by precision per traced step (trace.precision)
    memory_traffic: dict | None = None  # bandwidth-bound kernels' bytes and rate against peak (trace.memory_traffic)
    matrix_ops: dict | None = None  # matrix ops by shape and dtype, rate against peak (trace.matrix_ops)
    optimizer: dict | None = None  # the optimizer's step: class, implementation, host and device time (trace.optimizer)
    accumulation: dict | None = None  # DDP forward passes and optimizer steps per step (trace.accumulation)
    fsdp: dict | None = None  # FSDP's version, units and prefetches per step (trace.overlap)
    elementwise_chains: list[dict] = []  # runs of elementwise ops, fusion candidates (trace.fusion)
    sync_sites: list[dict] = []  # the job's frames calling the SYNC_OP_NAMES ops (trace.call_sites)
    collectives: list[dict] = []  # each collective call, for matching across ranks


class TraceRankFacts(msgspec.Struct, kw_only=True):
    """One rank of a trace, as measured (trace.analysis.trace_facts), in the order the document
    writes it; a run directory's window summary holds one per profiled window."""
    rank: int | None = None
    rank_from: str | None = None  # "argument" | "distributedInfo" | "file name" | "order"
    source: str = ""
    device: str = ""
    device_info: dict = {}
    world_size: int | None = None
    backend: str | None = None
    shares: dict[str, float] = {}
    measurements: dict[str, Any] = {}  # what the tree asks about, by metric name
    steps: list[TraceStepFacts] = []
    gpu_time: dict = {}  # HolisticTraceAnalysis's GPU-time breakdown, percent
    top_kernels: list[dict] = []
    top_ops: list[dict] = []
    causes: CauseFacts = msgspec.field(default_factory=CauseFacts)  # written as CauseFacts's keys, at the rank's top level
    mfu: float | None = None
    timeline: str = "cpu"  # "device" | "cpu"
    device_events_missing: bool = False  # a GPU process's trace without its device events
    op_coverage: float | None = None  # share of the host events the profiler numbered that the trace holds
    iterations: dict | None = None  # without ProfilerStep spans: the iterations judged (trace.iterations.Iterations)
    n_events: int = 0
    repairs: dict | None = None  # what the loader converted or skipped
    attribution_order: list[str] = []
    critical_path: dict | None = None
    what_if: list[dict] = []
    what_if_error: str | None = None
    wait_split: dict | msgspec.UnsetType = msgspec.UNSET  # {"measured": bool, "matched_collectives" | "reason"} (job.waits)
    waits_for: int | None | msgspec.UnsetType = msgspec.UNSET  # the rank this one waits for most
    wait_share: float | None | msgspec.UnsetType = msgspec.UNSET


class RunRankFacts(msgspec.Struct, kw_only=True):
    """One rank of a run directory, as measured (job.run_analysis.analyze_rank), in the order
    the document writes it."""
    rank: int
    source: str
    device: str | None = None
    device_info: dict | None = None  # peaks and host link, from the newest window that read them
    world_size: int | None = None
    backend: str | None = None  # the default process group's (rank.json), else the traces'
    host: str | None = None
    status: str | None = None
    error: str | None = None  # what ended the rank where it did not finish (rank.json's error)
    steps: list[RunStepFacts] = []
    gpu_time: dict = {}
    top_kernels: list[dict] = []
    top_ops: list[dict] = []
    causes: CauseFacts = msgspec.field(default_factory=CauseFacts)  # written as CauseFacts's keys, at the rank's top level
    mfu: float | None = None
    shares: dict[str, float] | None = None
    measurements: dict[str, Any] = {}  # over the counted steps (after warm-up)
    wait_split: dict = {}
    waits_for: int | None = None
    wait_share: float | None = None
    evidence: dict = {}  # steps by evidence, windows, samples, warm-up steps left out
    step_time_ms: dict = {}  # p50, p95, mean
    throughput: dict = {}  # samples_per_s, tokens_per_s
    model: dict | None = None  # what the live model and optimizer held
    loader: dict | None = None  # the wrapped DataLoader's settings (num_workers, pin_memory, ...)
    critical_path: dict | None = None
    what_if: list[dict] = []
    rates: dict | None = None  # FLOPs and the rate of the device work of the profiled steps


# A rank's facts, from a trace or from a run directory.
RankFacts = TraceRankFacts | RunRankFacts


class WindowFacts(msgspec.Struct, kw_only=True, frozen=True):
    """One profiler window of a run directory's rank as the run analysis reads it: its steps,
    its trace's file name, and its trace's facts, or why there are none. Held in memory only."""
    first_step: int | None = None
    last_step: int | None = None
    trace: str | None = None
    facts: TraceRankFacts | None = None
    error: str | None = None


class RankVerdict(msgspec.Struct, kw_only=True):
    """What the diagnosis judged of a rank (diagnosis.rank.judge_trace and judge_run_rank, then
    diagnosis.peers): its own verdict, each of its steps' and, on a run's rank, each of its
    profiler windows'. The document writes its keys after the facts' (`rank_document`)."""
    bound: str | None = None  # decision_tree.BOUNDS, None where withheld
    title: str | msgspec.UnsetType = msgspec.UNSET  # a trace's; a run's where its own work decides (diagnosis.peers)
    summary: str | msgspec.UnsetType = msgspec.UNSET
    path: list[dict] = []  # PathNode's keys
    fixes: list[str] = []
    sampled: bool | msgspec.UnsetType = msgspec.UNSET  # a trace's: too few of its host events for a firm verdict
    findings: list[dict] = []  # Finding's keys
    bound_via: int | msgspec.UnsetType = msgspec.UNSET  # bound through the rank it waits for (diagnosis.peers)
    steps: list[dict] = []  # Verdict's keys: each of the facts' steps', in their order (written into the steps)
    window_bounds: list[str | None] | msgspec.UnsetType = msgspec.UNSET  # a run's: each profiler window's (written into evidence.windows)


# The verdict's keys as the document writes them, after the facts' keys. A run's rank gets its
# title and summary only where its own work decides for a peer (diagnosis.peers), so they follow.
_TRACE_VERDICT_KEYS = ("bound", "title", "summary", "path", "fixes", "sampled", "findings", "bound_via")
_RUN_VERDICT_KEYS = ("bound", "path", "fixes", "findings", "title", "summary", "bound_via")
# What a judged step holds beyond its facts.
_STEP_VERDICT_KEYS = ("bound", "path")


class JudgedRank(msgspec.Struct, kw_only=True, frozen=True):
    """One rank of the analysis document: its facts and what the diagnosis judged of them. The
    document writes it as one object (`rank_document`); `document_ranks` reads it back."""
    facts: RankFacts  # written first, as facts_document writes them
    verdict: RankVerdict = msgspec.field(default_factory=RankVerdict)  # its keys after the facts'; its steps' in theirs

    @property
    def rank(self) -> int | None:
        return self.facts.rank


def judged_steps(r: JudgedRank) -> list[dict[str, Any]]:
    """The rank's steps as the document writes them: each step's facts with its verdict (a
    trace's steps say "sampled" where the trace was)."""
    facts, verdict = r.facts, r.verdict
    evidence = ("sampled" if verdict.sampled is True else "trace") if isinstance(facts, TraceRankFacts) else None
    out: list[dict[str, Any]] = []
    for s, v in zip(facts.steps, verdict.steps):
        step = {**s, "bound": v.get("bound"), "path": v.get("path") or []}
        if evidence is not None:
            step["evidence"] = evidence
        out.append(step)
    return out


def rank_document(r: JudgedRank) -> dict[str, Any]:
    """A judged rank as the document writes it: its facts' keys (`facts_document`) with its
    steps' and windows' verdicts written into them, then its verdict's keys, unset ones left out."""
    out = facts_document(r.facts)
    verdict = r.verdict
    out["steps"] = judged_steps(r)
    if isinstance(r.facts, RunRankFacts):
        keys = _RUN_VERDICT_KEYS
        if verdict.window_bounds is not msgspec.UNSET:
            evidence = dict(r.facts.evidence)
            evidence["windows"] = [{**row, "bound": b} for row, b in
                                   zip(evidence.get("windows") or [], verdict.window_bounds)]
            out["evidence"] = evidence
    else:
        keys = _TRACE_VERDICT_KEYS
    for name in keys:
        value = getattr(verdict, name)
        if value is not msgspec.UNSET:
            out[name] = value
    return out


def json_safe(obj):
    """The document with non-finite floats as null (JSON has no inf/NaN) and numpy scalars as Python."""
    t = type(obj)  # exact types first: a large document is mostly plain leaves
    if t is str or t is int or t is bool or obj is None:
        return obj
    if t is float:
        return obj if obj - obj == 0.0 else None  # NaN and +-inf give NaN
    if t is dict:
        return {k if type(k) is str else str(k): json_safe(v) for k, v in obj.items()}
    if t is list:
        return [json_safe(v) for v in obj]
    if t is JudgedRank:  # its facts and verdict, one object
        return json_safe(rank_document(obj))
    if isinstance(obj, msgspec.Struct):  # a typed document: its JSON object, unset fields left out
        return {name: json_safe(v) for name in obj.__struct_fields__ if (v := getattr(obj, name)) is not msgspec.UNSET}
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, float):  # numpy's float64: inf - inf would warn, so compared instead
        return obj if obj == obj and obj not in (float("inf"), float("-inf")) else None
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalar
        return json_safe(obj.item())
    return obj


def document_ranks(raw: dict) -> list[JudgedRank]:
    """The judged ranks of an analysis document's JSON object (a rank without an integer number
    is left out)."""
    ranks = raw.get("ranks")
    return [judged_rank_from_document(r, r["rank"]) for r in (ranks if isinstance(ranks, list) else [])
            if type(r) is dict and isinstance(r.get("rank"), int) and not isinstance(r["rank"], bool)]


def judged_rank_from_document(raw: dict, rank: int) -> JudgedRank:
    """A judged rank from its dict in an analysis document: its facts (the verdicts written into
    its steps and windows taken out) and its verdict."""
    steps = raw.get("steps")
    steps = [s for s in steps if isinstance(s, dict)] if isinstance(steps, list) else []
    # A sampled trace's steps say so (judged_steps); as measured, each was traced.
    measured_as = "trace" if raw.get("sampled") is True and not RUN_ONLY_FIELDS & raw.keys() else None
    facts_raw = {**raw, "steps": [_step_facts(s, measured_as) for s in steps]}
    verdict = {k: raw[k] for k in _TRACE_VERDICT_KEYS if k in raw}
    verdict["steps"] = [{k: s.get(k) for k in _STEP_VERDICT_KEYS} for s in steps]
    evidence = raw.get("evidence")
    windows = evidence.get("windows") if isinstance(evidence, dict) else None
    if isinstance(evidence, dict) and isinstance(windows, list) and any(isinstance(w, dict) and "bound" in w
                                                                        for w in windows):
        rows = [w for w in windows if isinstance(w, dict)]
        verdict["window_bounds"] = [w.get("bound") if isinstance(w.get("bound"), str) else None for w in rows]
        facts_raw["evidence"] = {**evidence, "windows": [{k: v for k, v in w.items() if k != "bound"} for w in rows]}
    return JudgedRank(facts=rank_facts_from_document(facts_raw, rank), verdict=settled(verdict, RankVerdict))


def _step_facts(step: dict, measured_as: str | None) -> dict:
    out = {k: v for k, v in step.items() if k not in _STEP_VERDICT_KEYS}
    if measured_as is not None and "evidence" in out:
        out["evidence"] = measured_as
    return out


class _JobParts(msgspec.Struct, kw_only=True):
    """The facts of the job block, in the order the document writes them."""
    world_size: int | None = None
    ranks_present: list[int] = []
    critical_path: dict | None = None  # the job's critical path over its ranks' replayed steps
    what_if: list[dict] = []  # each what-if change replayed over the job's ranks
    missing_ranks: list[int] = []
    duplicate_ranks: list[dict] = []  # {"rank", "source"}: a rank two traces claim
    unnamed_traces: list[str | None] = []  # traces whose rank no distributedInfo names
    findings: list[dict] = []  # Finding's keys; a saved document's are read as they are
    collectives: dict = {}  # the ranks' collectives matched: counts, comm and wait ms, bus bandwidth
    reports: dict | None | msgspec.UnsetType = msgspec.UNSET  # a run directory's: each rank's last report (analyze.job_facts)


# The job block's facts, which its judged form carries as they were measured.
JOB_FACT_FIELDS: tuple[str, ...] = _JobParts.__struct_fields__


class JobFacts(_JobParts, kw_only=True):
    """The "job" part of the document, as measured across the ranks (job.cross_rank.analyze_job)."""
    collective_facts: Any = None  # the stragglers' input (job.cross_rank.CollectiveFacts), held in memory only


class Job(_JobParts, kw_only=True):
    """The job block with its verdict (diagnosis.verdict.job_verdict)."""
    stragglers: list[dict] = []
    rank_waits: list[dict] = []
    bound: str | None = None
    cause: str | None = None  # what the communication waits on, where the job is comm-bound
    path: list[dict] = []  # PathNode's keys
    fixes: list[str] = []
    verdict_source: str = "none"  # "measurements" | "rank verdicts" | "none"
    borderline: dict | None = None  # the deciding measurement within its noise of a threshold
    measurements: dict | None = None  # the measurement set the verdict rests on
    bound_counts: dict[str, int] = {}  # ranks by their own bound


ANALYSIS_SCHEMA = "diag.analysis/1"


class AnalysisFacts(msgspec.Struct, kw_only=True):
    """What the fact stages measured of one job, before any judgement (held in memory only): a
    run directory's (job.run_analysis.analyze_run), or the facade's over traces and run
    directories. Its job block is `analyze_job`'s, or a hand-made one already holding
    stragglers and rank waits."""
    source: str | msgspec.UnsetType = msgspec.UNSET  # as Analysis's
    run: dict | msgspec.UnsetType = msgspec.UNSET  # as Analysis's
    ranks: list[RankFacts] = []
    job: JobFacts | Job = msgspec.field(default_factory=JobFacts)
    errors: list[dict] = []  # as Analysis's
    warnings: list[dict] | msgspec.UnsetType = msgspec.UNSET  # as Analysis's


class Analysis(msgspec.Struct, kw_only=True):
    """diag.analysis/1: what `diag analyze --json` prints (traces, run directories, or both), and
    a run directory's own analysis, with its diagnosis; its fields in the order the document
    writes them. Built by the facade (analyze.with_diagnosis), or read back from its JSON by
    `analysis_from_json`."""
    schema: str = ANALYSIS_SCHEMA
    source: str | msgspec.UnsetType = msgspec.UNSET  # a run directory's analysis: the directory
    run: dict | msgspec.UnsetType = msgspec.UNSET  # a run directory's: its manifest's id, status, times, hosts, versions, config
    ranks: list[JudgedRank] = []  # each written by rank_document
    job: Job = msgspec.field(default_factory=Job)
    errors: list[dict] = []  # {"source", "error"}: inputs that could not be analysed
    warnings: list[dict] | msgspec.UnsetType = msgspec.UNSET  # {"source", "warning"}: what the traces disagree on (diag analyze)
    diagnosis: Diagnosis | None = None  # None only in a saved document without one

    @property
    def source_path(self) -> str | None:
        return self.source if isinstance(self.source, str) else None


def analysis_from_json(raw: dict) -> Analysis:
    """An analysis document read back from its JSON object (a saved `diag analyze --json`, or a
    hand-made one): each part by its own reader, what a part cannot hold left out. Its ranks
    without an integer number are left out (`document_ranks`); its job block is read as a `Job`
    (a value a field cannot hold reads as absent); its lists of errors and warnings keep their
    objects only."""
    job = raw.get("job")
    source, run = raw.get("source"), raw.get("run")
    return Analysis(
        source=source if isinstance(source, str) else msgspec.UNSET,
        run=run if type(run) is dict else msgspec.UNSET,
        ranks=document_ranks(raw),
        job=settled(job, Job) if type(job) is dict else Job(),
        errors=_objects(raw.get("errors")),
        warnings=_objects(raw.get("warnings")) if "warnings" in raw else msgspec.UNSET,
        diagnosis=diagnosis_from_json(raw.get("diagnosis")),
    )


def _objects(entries) -> list[dict]:
    return [e for e in entries if type(e) is dict] if isinstance(entries, list) else []


def facts_document(facts: TraceRankFacts | RunRankFacts) -> dict[str, Any]:
    """A rank's facts as the document writes them: its fields in order, with CauseFacts's keys
    in place of `causes` and the unset ones left out (the values are shared, not copied)."""
    out: dict[str, Any] = {}
    for name in facts.__struct_fields__:
        value = getattr(facts, name)
        if name == "causes":
            out.update({k: getattr(value, k) for k in value.__struct_fields__})
        elif value is not msgspec.UNSET:
            out[name] = value
    return out


def trace_facts_from_document(raw: dict) -> TraceRankFacts:
    """A trace rank's facts from their document form (a window summary's "analysis"), their
    types settled where they are read: a value a field cannot hold reads as absent
    (diag.typed_json). Its steps are taken as they are (every reader of a step checks what it
    reads)."""
    return _facts_from_document(raw, TraceRankFacts, {})


def rank_facts_from_document(raw: dict, rank: int) -> TraceRankFacts | RunRankFacts:
    """The facts of rank `rank` from its dict in an analysis document: a run directory's
    (it holds what only a run records: its evidence, model, loader, status, ...), else a
    trace's."""
    if RUN_ONLY_FIELDS & raw.keys():
        return _facts_from_document(raw, RunRankFacts, {"rank": rank, "source": str(raw.get("source") or "")})
    return _facts_from_document(raw, TraceRankFacts, {"rank": rank})


# What a run directory's rank holds and a trace's does not.
RUN_ONLY_FIELDS = frozenset(RunRankFacts.__struct_fields__) - frozenset(TraceRankFacts.__struct_fields__)


F = TypeVar("F", TraceRankFacts, RunRankFacts)


class _CollectiveShape(msgspec.Struct, forbid_unknown_fields=False):
    """What a collective record read back from a document must hold for the ranks' records to
    be matched (job.cross_rank.match_collectives): its keys hashable, its times numbers."""
    name: str
    ts_us: float
    dur_us: float | None = None
    pg: str | int | None = None
    seq: int | None = None
    step: int | None = None
    bytes: float | None = None
    on: str | None = None
    exposed: list[tuple[float, float]] | None = None


def _facts_from_document(raw: dict, kind: type[F], base: dict[str, Any]) -> F:
    causes = settled({k: raw[k] for k in CauseFacts.__struct_fields__ if k in raw}, CauseFacts)
    # A damaged record is left out: matched across ranks, its odd keys would stop the others'.
    causes.collectives = [c for c in causes.collectives if fits(c, _CollectiveShape)]
    own = {k: v for k, v in raw.items() if k in kind.__struct_fields__ and k not in ("causes", "steps", *base)}
    facts = settled({**own, **base, "causes": causes}, kind, base)
    steps = raw.get("steps")
    facts.steps = [cast(Any, s) for s in steps if isinstance(s, dict)] if isinstance(steps, list) else []
    return facts
