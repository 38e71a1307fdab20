"""The parts of the analysis document (schema diag.analysis/1) that pass between the stages,
declared: what the analysis measures (the facts) and what the diagnosis adds (the verdicts).

A rank's parts are still dicts, declared by these TypedDicts (which keys each holds and in
what unit); the job block is a msgspec Struct, `JobFacts` as measured and `Job` as judged.
Each stage returns a new value of the next type (`trace_facts` gives a `TraceRankFacts`,
`diagnosis.rank.judge_trace` makes it a `TraceRank`; `analyze_job` gives a `JobFacts`,
`diagnosis.verdict.job_verdict` makes it a `Job`) and never rewrites its input.
`tests/test_analysis_types.py` checks real outputs against these declarations, so a key
added or dropped in one stage must be declared here. Shares are fractions of the step's
wall time; `_us` is microseconds on the trace's clock, `_ms` milliseconds.

Imports nothing from diag: every layer may read it. (No `from __future__ import
annotations`: TypedDict reads NotRequired from evaluated annotations.)
"""

import re
from typing import Any, NotRequired, TypedDict

import msgspec

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


class _WaitSplit(TypedDict, total=False):
    """Added by the wait split (job.waits) to every analysis of a job."""
    wait_split: dict  # {"measured": bool, "matched_collectives" | "reason"}
    waits_for: int | None  # the rank this one waits for most
    wait_share: float | None


class CauseFacts(TypedDict):
    """What the cause rules read of a rank, per traced step (trace.analysis); a run directory's
    rank holds the same, from its profiled windows."""
    copies: list[dict]  # device copies by kind, per traced step (trace.host_device)
    launches: dict | None  # kernel launches per traced step (trace.host_device)
    allocator: list[dict]  # cudaMalloc/cudaFree-family calls per traced step (trace.host_device)
    cpu_work: list[dict]  # ops of the training thread that run on the CPU, per traced step (trace.host_device)
    python_gaps: dict | None  # the training thread's time outside every op, and the frames holding it (trace.python_gaps)
    memory_traffic: dict | None  # bandwidth-bound kernels' bytes and rate against peak (trace.memory_traffic)
    math: dict | None  # matrix kernels' time by precision per traced step (trace.precision)
    matrix_ops: dict | None  # matrix ops by shape and dtype, rate against peak (trace.matrix_ops)
    optimizer: dict | None  # the optimizer's step: class, implementation, host and device time (trace.optimizer)
    accumulation: dict | None  # DDP forward passes and optimizer steps per step (trace.accumulation)
    fsdp: dict | None  # FSDP's version, units and prefetches per step (trace.overlap)
    elementwise_chains: list[dict]  # runs of elementwise ops, fusion candidates (trace.fusion)
    sync_sites: list[dict]  # the job's frames calling the SYNC_OP_NAMES ops (trace.call_sites)
    collectives: list[dict]  # each collective call, for matching across ranks


class TraceRankFacts(_WaitSplit, CauseFacts):
    """One rank of a trace, as measured (trace.analysis.trace_facts)."""
    rank: int | None
    rank_from: str | None  # "argument" | "distributedInfo" | "file name" | "order"
    source: str
    device: str
    device_info: dict
    world_size: int | None
    backend: str | None
    shares: dict[str, float]
    measurements: dict[str, float]
    steps: list[TraceStepFacts]
    gpu_time: dict  # HolisticTraceAnalysis's GPU-time breakdown, percent
    top_kernels: list[dict]
    top_ops: list[dict]
    mfu: float | None
    timeline: str  # "device" | "cpu"
    device_events_missing: bool  # a GPU process's trace without its device events
    op_coverage: float | None  # share of the host events the profiler numbered that the trace holds
    iterations: dict | None  # without ProfilerStep spans: the iterations judged (trace.iterations.Iterations)
    n_events: int
    repairs: dict | None  # what the loader converted or skipped
    attribution_order: list[str]
    critical_path: dict | None
    what_if: list[dict]
    what_if_error: str | None


class _RankVerdict(TypedDict):
    bound: str | None
    path: list[PathNode]
    fixes: list[str]
    findings: list[Finding]


class _Titled(TypedDict):
    title: str
    summary: str


class TraceRank(TraceRankFacts, _RankVerdict, _Titled):
    """A trace's rank with its verdicts (diagnosis.rank.judge_trace)."""
    steps: list[TraceStep]  # type: ignore[misc]
    sampled: bool  # the trace holds too few of its host events for a firm verdict
    bound_via: NotRequired[int]  # bound through the rank it waits for (diagnosis.peers)


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


class RunRankFacts(CauseFacts):
    """One rank of a run directory, as measured (job.run_analysis.analyze_rank)."""
    rank: int
    source: str
    device: str | None
    device_info: dict | None  # peaks and host link, from the newest window that read them
    world_size: int | None
    backend: str | None  # the default process group's (rank.json), else the traces'
    host: str | None
    status: str | None
    error: str | None  # what ended the rank where it did not finish (rank.json's error)
    steps: list[RunStepFacts]
    gpu_time: dict
    top_kernels: list[dict]
    top_ops: list[dict]
    mfu: float | None
    shares: dict[str, float] | None
    measurements: dict[str, float]  # over the counted steps (after warm-up)
    wait_split: dict
    waits_for: int | None
    wait_share: float | None
    evidence: dict  # steps by evidence, windows, samples, warm-up steps left out
    step_time_ms: dict  # p50, p95, mean
    throughput: dict  # samples_per_s, tokens_per_s
    model: dict | None  # what the live model and optimizer held
    loader: dict | None  # the wrapped DataLoader's settings (num_workers, pin_memory, ...)
    critical_path: dict | None
    what_if: list[dict]
    rates: dict | None  # FLOPs and the rate of the device work of the profiled steps


class RunRank(RunRankFacts, _RankVerdict):
    """A run directory's rank with its verdicts (diagnosis.rank.judge_run_rank)."""
    steps: list[RunStep]  # type: ignore[misc]
    title: NotRequired[str]  # given where its own work decides (diagnosis.peers)
    summary: NotRequired[str]
    bound_via: NotRequired[int]


# A rank with its verdicts, from a trace or from a run directory.
Rank = TraceRank | RunRank


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


class AnalysisDocument(TypedDict):
    """diag.analysis/1: what `diag analyze --json` prints (traces, run directories, or both), and
    a run directory's own analysis (job.run_analysis.analyze_run) with its diagnosis."""
    schema: str
    source: NotRequired[str]  # a run directory's analysis: the directory
    run: NotRequired[dict]  # a run directory's analysis: its manifest's id, status, times, hosts, versions, config
    ranks: list[Rank]
    job: Job
    errors: list[dict]  # {"source", "error"}: inputs that could not be analysed
    warnings: NotRequired[list[dict]]  # {"source", "warning"}: what the traces disagree on (diag analyze)
    diagnosis: object  # a diag.diagnosis_document.Diagnosis (its JSON object once written)
