"""The one declarative table of every metric diag exports.

Prometheus registration (`registry.py`), the metrics reference (`docs.py` ->
dashboards/METRICS.md), the Grafana dashboards and alert rules (dashboards/generate.py)
and their tests are all derived from this table, so a metric cannot be renamed in one
place and silently stay behind in another.

Conventions (https://prometheus.io/docs/practices/naming/): the prefix `diag_`, base
units in the name (seconds, bytes, ratio 0-1, watts, joules, celsius, hertz), `_total`
on counters, and static details carried once by the `*_info` metrics instead of on every
series. Every series also carries the identity labels below, set once per endpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diag.analyzers.diagnosis.straggler_episodes import KINDS
from diag.analyzers.diagnosis.throttle import CLOCK_EVENTS

PREFIX = "diag_"

# Set once per rank's endpoint from the agent's identity.
IDENTITY_LABELS = ("run", "rank", "local_rank", "host", "gpu")

# Fixed label values, exported from the start (as 0) so series counts are stable and
# rate() works from the first scrape.
BOUNDS = ("data", "host", "comm", "memory", "compute")
# Step time also goes to "wait" (waiting at collectives for other ranks) once the job
# analysis has matched collectives across ranks. A step whose record has no shares still
# has its data wait; the rest of it is "unattributed" rather than guessed.
CLASSES = ("data", "host", "comm", "wait", "memory", "compute")
# Where a step's time goes in the exporter: the six classes, and what a step without shares leaves.
STEP_PHASES = CLASSES + ("unattributed",)
# NVML clock event (throttle) reasons, named as the NVML sampler names them in samples
# (the sample record: diag.collectors.sampler). Unknown reason bits are exported as reason="other".
CLOCK_EVENT_REASONS = tuple(CLOCK_EVENTS)
STRAGGLER_KINDS = KINDS  # straggler episodes over time (diagnosis.straggler_episodes)
DIRECTIONS_NET = ("rx", "tx")
DIRECTIONS_DISK = ("read", "write")
OBSERVATION_KINDS = ("step", "sample", "window", "nccl", "event", "diagnosis")
ERROR_STAGES = OBSERVATION_KINDS + ("collect",)

# Label values that come from data (finding ids, collective names, unknown clock event
# reasons) are capped per metric so a flood of new values cannot blow up the series
# count; the excess is folded into "other".
MAX_DYNAMIC_VALUES = 16

# Step durations from a few milliseconds (small models) to minutes (huge pipelines).
STEP_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

TYPES = ("counter", "gauge", "histogram", "info")
UNITS = ("", "seconds", "bytes", "ratio", "watts", "joules", "celsius", "hertz", "bytes_per_second")

# Where a metric appears, for the live-Prometheus test and for dashboard readers:
#   always   from the first scrape of a training rank (CPU or GPU)
#   gpu      on ranks with a GPU sampled through NVML or amdsmi, where the device supports it
#   window   after the first profiler window was analysed on the rank
#   nccl     after `diag nccl` results or NCCL logs were handed to the exporter
#   event    only when the event happens (an OOM, a finding); absent otherwise
APPEARS = ("always", "gpu", "window", "nccl", "event")


@dataclass(frozen=True)
class Metric:
    name: str
    type: str
    unit: str
    help: str
    source: str  # what feeds it: step record, sample.gpu/.host, window, diagnosis, nccl_bench, nccl_log, agent, exporter
    labels: tuple[str, ...] = ()
    appears: str = "always"
    # Fixed values of the (single) label, exported from the start; () = values come from data.
    label_values: tuple[str, ...] = ()
    buckets: tuple[float, ...] = field(default=())

    @property
    def event_only(self) -> bool:
        return self.appears == "event"

    def sample_names(self) -> tuple[str, ...]:
        """The series names this metric puts into the exposition."""
        if self.type == "histogram":
            return (self.name + "_bucket", self.name + "_sum", self.name + "_count")
        return (self.name,)


M = Metric
METRICS: tuple[Metric, ...] = (
    # ---- static details ----
    M("diag_build_info", "info", "", "Constant 1; labels carry the diag, Python and PyTorch versions.",
      "exporter", labels=("version", "python", "torch")),
    M("diag_gpu_info", "info", "", "Constant 1; labels carry the GPU's model name and UUID.",
      "sample.gpu", labels=("name", "uuid"), appears="gpu"),
    # ---- training ----
    M("diag_steps_total", "counter", "", "Training steps completed.", "step"),
    M("diag_step_duration_seconds", "histogram", "seconds",
      "Wall time of a training step (monotonic clock).", "step", buckets=STEP_DURATION_BUCKETS),
    M("diag_step_device_seconds", "histogram", "seconds",
      "Device time of a training step, between timing events at its boundaries on the training "
      "stream (CUDA or HIP; no samples on CPU ranks).", "step", buckets=STEP_DURATION_BUCKETS),
    M("diag_step_phase_seconds_total", "counter", "seconds",
      "Step time attributed to each phase by the decision tree's shares; without shares, the "
      "data wait goes to data and the rest to unattributed.", "step",
      labels=("phase",), label_values=STEP_PHASES),
    M("diag_step_bound_total", "counter", "",
      "Steps by verdict (the bound class), from trace or sampled evidence.", "step",
      labels=("bound",), label_values=BOUNDS),
    M("diag_job_bound", "gauge", "",
      "The job's verdict from its diagnosis: 1 for the bound class, 0 for the others. Set when the "
      "job report is written (rank 0) or by `diag export` from summary.json.", "diagnosis",
      labels=("bound",), appears="event"),
    M("diag_job_phase_ratio", "gauge", "ratio",
      "Share of step time in each phase over the steps the job verdict rests on (the diagnosis's "
      "measurement set).", "diagnosis", labels=("phase",), appears="event"),
    M("diag_job_straggler_episode_active", "gauge", "",
      "1 when the job's last recorded steps are in a straggler episode of this kind (persistent: one rank "
      "late for most of the run; rotating: the late rank moves; transient: a burst), else 0; from the "
      "diagnosis.", "diagnosis", labels=("kind",), label_values=STRAGGLER_KINDS, appears="event"),
    M("diag_job_straggler_lost_seconds", "gauge", "seconds",
      "Job time lost waiting for late ranks in straggler episodes of this kind, beyond the median rank; "
      "from the diagnosis.", "diagnosis", labels=("kind",), label_values=STRAGGLER_KINDS, appears="event"),
    M("diag_data_wait_seconds_total", "counter", "seconds",
      "Time spent waiting for the next batch, measured by agent.loader().", "step"),
    M("diag_last_step_timestamp_seconds", "gauge", "seconds",
      "Unix time at which the last step ended; before the first step, the exporter's start time "
      "(so a job hung at start-up also shows as stalled).", "step"),
    M("diag_samples_total", "counter", "", "Samples processed, from agent.step(samples=...).", "step"),
    M("diag_tokens_total", "counter", "", "Tokens processed, from agent.step(tokens=...).", "step"),
    M("diag_mfu_ratio", "gauge", "ratio",
      "Model FLOPs utilisation (achieved / peak FLOP/s): of the last step when the agent was given "
      "the model's FLOPs per sample or token, else of the last analysed profiler window.",
      "window", appears="window"),
    M("diag_comm_compute_overlap_ratio", "gauge", "ratio",
      "Share of communication time overlapped by computation in the last analysed profiler window.",
      "window", appears="window"),
    M("diag_analysis_findings", "gauge", "",
      "Findings of the last analysed profiler window, by finding id.", "window",
      labels=("id",), appears="event"),
    M("diag_step_peak_memory_bytes", "gauge", "bytes",
      "Peak device memory allocated so far, as the caching allocator counts it (diag never resets "
      "it), at the last step.", "step", appears="gpu"),
    M("diag_profiler_window_active", "gauge", "",
      "1 while a profiler window records this rank's steps (scheduled or requested), else 0.", "agent"),
    M("diag_oom_errors_total", "counter", "",
      "Out-of-memory errors reported in the agent's events (an OutOfMemoryError raised in the training "
      "loop); 0 from the start, so the first error is an increase.", "agent"),
    # ---- device ----
    M("diag_gpu_utilization_ratio", "gauge", "ratio",
      "Fraction of the last sample period during which a kernel ran on the GPU.", "sample.gpu", appears="gpu"),
    M("diag_gpu_memory_used_bytes", "gauge", "bytes", "Device memory in use.", "sample.gpu", appears="gpu"),
    M("diag_gpu_memory_total_bytes", "gauge", "bytes", "Device memory capacity.", "sample.gpu", appears="gpu"),
    M("diag_gpu_power_watts", "gauge", "watts", "Power draw.", "sample.gpu", appears="gpu"),
    M("diag_gpu_energy_joules_total", "counter", "joules",
      "Energy consumed since the driver was loaded.", "sample.gpu", appears="gpu"),
    M("diag_gpu_temperature_celsius", "gauge", "celsius", "GPU die temperature.", "sample.gpu", appears="gpu"),
    M("diag_gpu_sm_clock_hertz", "gauge", "hertz", "Streaming multiprocessor clock.", "sample.gpu",
      appears="gpu"),
    M("diag_gpu_clock_event_active", "gauge", "",
      "1 while the clocks are reduced for this reason (NVML clock event / throttle reasons), else 0.",
      "sample.gpu", labels=("reason",), label_values=CLOCK_EVENT_REASONS, appears="gpu"),
    M("diag_gpu_pcie_bytes_total", "counter", "bytes",
      "PCIe traffic, integrated from the sampled throughput.", "sample.gpu",
      labels=("direction",), label_values=DIRECTIONS_NET, appears="gpu"),
    M("diag_gpu_nvlink_bytes_total", "counter", "bytes", "NVLink traffic over all links.", "sample.gpu",
      labels=("direction",), label_values=DIRECTIONS_NET, appears="gpu"),
    M("diag_gpu_xid_errors_total", "counter", "", "XID errors reported by the driver for this GPU.",
      "sample.gpu", appears="gpu"),
    M("diag_gpu_ecc_errors_total", "counter", "", "ECC errors (corrected and uncorrected).",
      "sample.gpu", appears="gpu"),
    # ---- host ----
    M("diag_host_cpu_ratio", "gauge", "ratio", "Host CPU utilisation over all cores.", "sample.host"),
    M("diag_host_cpu_iowait_ratio", "gauge", "ratio",
      "Share of all cores' time idle while I/O is outstanding (Linux).", "sample.host"),
    M("diag_host_memory_used_bytes", "gauge", "bytes", "Host memory in use.", "sample.host"),
    M("diag_host_memory_total_bytes", "gauge", "bytes", "Host memory capacity.", "sample.host"),
    M("diag_host_disk_bytes_total", "counter", "bytes", "Bytes read from and written to local disks.",
      "sample.host", labels=("direction",), label_values=DIRECTIONS_DISK),
    M("diag_host_network_bytes_total", "counter", "bytes", "Bytes received and sent on all interfaces.",
      "sample.host", labels=("direction",), label_values=DIRECTIONS_NET),
    M("diag_process_cpu_ratio", "gauge", "ratio",
      "CPU used by the training process, in cores (1.0 = one core busy).", "sample.host"),
    M("diag_process_resident_memory_bytes", "gauge", "bytes", "Resident memory of the training process.",
      "sample.host"),
    M("diag_dataloader_workers", "gauge", "", "Live DataLoader worker processes.", "sample.host"),
    M("diag_dataloader_workers_cpu_ratio", "gauge", "ratio",
      "CPU used by the DataLoader worker processes, in cores.", "sample.host"),
    M("diag_process_read_bytes_per_second", "gauge", "bytes_per_second",
      "Bytes the training process read from storage per second.", "sample.host"),
    M("diag_dataloader_workers_read_bytes_per_second", "gauge", "bytes_per_second",
      "Bytes the DataLoader worker processes read from storage per second.", "sample.host"),
    # ---- communication ----
    M("diag_nccl_bus_bandwidth_bytes_per_second", "gauge", "bytes_per_second",
      "Average bus bandwidth of the last `diag nccl` run, by collective (nccl-tests busbw).",
      "nccl_bench", labels=("collective",), appears="nccl"),
    M("diag_nccl_findings", "gauge", "", "Findings of the last parsed NCCL logs, by finding id.",
      "nccl_log", labels=("id",), appears="event"),
    # ---- the exporter itself ----
    M("diag_exporter_collect_duration_seconds", "gauge", "seconds",
      "Time the previous scrape took to collect the metrics.", "exporter"),
    M("diag_exporter_scrapes_total", "counter", "", "Scrapes served.", "exporter"),
    M("diag_exporter_observations_total", "counter", "", "Records handed to the exporter, by kind.",
      "exporter", labels=("kind",), label_values=OBSERVATION_KINDS),
    M("diag_exporter_errors_total", "counter", "",
      "Records the exporter could not use or scrapes that failed, by stage.", "exporter",
      labels=("stage",), label_values=ERROR_STAGES),
)

BY_NAME: dict[str, Metric] = {m.name: m for m in METRICS}


def series_names() -> dict[str, Metric]:
    """Every name that can appear in the exposition (histogram parts included) -> its metric."""
    return {s: m for m in METRICS for s in m.sample_names()}


def validate(metrics=METRICS) -> list[str]:
    """Convention problems in the table; empty when it is sound (tests assert that)."""
    problems = []
    seen = set()
    for m in metrics:
        where = m.name
        if m.name in seen:
            problems.append(f"{where}: duplicate name")
        seen.add(m.name)
        if not m.name.startswith(PREFIX):
            problems.append(f"{where}: missing prefix {PREFIX}")
        if m.type not in TYPES:
            problems.append(f"{where}: unknown type {m.type}")
        if m.unit not in UNITS:
            problems.append(f"{where}: unknown unit {m.unit}")
        if m.appears not in APPEARS:
            problems.append(f"{where}: unknown appears {m.appears}")
        if m.type == "counter" and not m.name.endswith("_total"):
            problems.append(f"{where}: counter without _total")
        if m.type != "counter" and m.name.endswith("_total"):
            problems.append(f"{where}: _total on a {m.type}")
        if m.type == "info" and not m.name.endswith("_info"):
            problems.append(f"{where}: info metric not named *_info")
        if m.unit:
            stem = m.name[: -len("_total")] if m.name.endswith("_total") else m.name
            if not stem.endswith("_" + m.unit):
                problems.append(f"{where}: unit {m.unit} not at the end of the name")
        if m.type == "histogram" and not m.buckets:
            problems.append(f"{where}: histogram without buckets")
        if set(m.labels) & set(IDENTITY_LABELS) or "le" in m.labels:
            problems.append(f"{where}: label clashes with identity labels or le")
        if m.label_values and len(m.labels) != 1:
            problems.append(f"{where}: fixed label values need exactly one label")
        if not m.help.strip():
            problems.append(f"{where}: no help")
    return problems
