"""Write the Grafana dashboards, the Prometheus alert rules and the metrics reference.

    python dashboards/generate.py            # rewrite the committed files in dashboards/
    python dashboards/generate.py --out DIR  # write them elsewhere (the test compares)

Everything is derived from the metric table (diag.exporter.metrics_table): a panel or rule
may only name metrics the table declares, so a renamed metric fails here instead of
leaving an empty panel behind. Alert thresholds for data wait and exposed communication
come from the decision tree, so an alert and a verdict never disagree.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml
from grafana_foundation_sdk.builders import bargauge, common, prometheus, stat, table, timeseries
from grafana_foundation_sdk.builders import dashboard as gdash
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as common_m
from grafana_foundation_sdk.models import dashboard as gdash_m
from grafana_foundation_sdk.models import prometheus as prometheus_m

from diag.analyzers.diagnosis.decision_tree import load_tree
from diag.exporter import docs
from diag.exporter.metrics_table import series_names

HERE = Path(__file__).resolve().parent
DS = gdash_m.DataSourceRef(type_val="prometheus", uid="${DS_PROMETHEUS}")
SEL = 'run=~"$run", host=~"$host", rank=~"$rank"'
RI = "$__rate_interval"
# Series produced by Prometheus itself for every target; allowed in the exporter dashboard.
PROMETHEUS_SERIES = ("up", "scrape_duration_seconds", "scrape_samples_scraped")


def sel(extra: str = "") -> str:
    return "{" + SEL + (", " + extra if extra else "") + "}"


def mean_step(window: str = RI, by: str = "run, host, rank") -> str:
    """Mean step time per rank over a window, from the histogram's sum and count."""
    return (f"(sum by ({by}) (rate(diag_step_duration_seconds_sum{sel()}[{window}])) / "
            f"sum by ({by}) (rate(diag_step_duration_seconds_count{sel()}[{window}])))")


def share_of_step(numerator: str, window: str = RI, by: str = "run, host, rank") -> str:
    """A rate of seconds divided by the rate of step seconds: a fraction of the step."""
    return (f"sum by ({by}) (rate({numerator}[{window}])) / "
            f"sum by ({by}) (rate(diag_step_duration_seconds_sum{sel()}[{window}]))")


# ---------------------------------------------------------------------------- panels
@dataclass
class P:
    title: str
    targets: list  # [(expr, legend)]
    unit: str = "short"
    kind: str = "timeseries"  # timeseries | stat | table | bargauge
    description: str = ""
    width: int = 12
    height: int = 8
    stacked: bool = False
    max: float | None = None


def row(title: str) -> str:
    """A collapsible row header between panels."""
    return title


TRAINING = [
    row("Throughput"),
    P("Steps per second", [(f"sum by (run) (rate(diag_steps_total{sel()}[{RI}]))", "{{run}}")],
      "ops", "stat", "Job throughput in steps per second (all selected ranks).", 6, 4),
    P("Stall timer (slowest rank)", [(f"time() - min by (run) (diag_last_step_timestamp_seconds{sel()})",
                                       "{{run}}")],
      "s", "stat", "Seconds since the least recent step end of any rank; grows without bound when a "
                   "rank hangs (or the job hangs at start-up).", 6, 4),
    P("Straggler ratio (max/median step time)",
      [(f"max by (run) ({mean_step()}) / quantile by (run) (0.5, {mean_step()})", "{{run}}")],
      "short", "stat", "The slowest rank's mean step time over the median rank's; 1.0 means balanced.",
      6, 4),
    P("MFU", [(f"avg by (run) (diag_mfu_ratio{sel()})", "{{run}}")], "percentunit", "stat",
      "Model FLOPs utilisation of the last profiler window, averaged over ranks.", 6, 4, max=1),
    P("Samples and tokens per second",
      [(f"sum by (run) (rate(diag_samples_total{sel()}[{RI}]))", "samples/s {{run}}"),
       (f"sum by (run) (rate(diag_tokens_total{sel()}[{RI}]))", "tokens/s {{run}}")],
      "short", description="Job throughput from agent.step(samples=..., tokens=...)."),
    P("MFU per rank", [(f"diag_mfu_ratio{sel()}", "rank {{rank}}")], "percentunit",
      description="Model FLOPs utilisation of each rank's last analysed profiler window.", max=1),
    row("Step time"),
    P("Step time p50 / p95 per rank",
      [(f"histogram_quantile(0.5, sum by (rank, le) (rate(diag_step_duration_seconds_bucket{sel()}[{RI}])))",
        "p50 rank {{rank}}"),
       (f"histogram_quantile(0.95, sum by (rank, le) (rate(diag_step_duration_seconds_bucket{sel()}[{RI}])))",
        "p95 rank {{rank}}")],
      "s", description="Quantiles estimated from the step-duration histogram."),
    P("Stragglers: step time / median step time per rank",
      [(f"{mean_step()} / on (run) group_left () quantile by (run) (0.5, {mean_step()})", "rank {{rank}}")],
      "short", description="Each rank's mean step time over the median rank's. A rank well above 1 is a "
                           "straggler; in synchronous data parallelism every other rank waits for it."),
    P("Stall timer per rank", [(f"time() - diag_last_step_timestamp_seconds{sel()}", "rank {{rank}}")], "s",
      description="Seconds since each rank's last step ended."),
    P("Device step time p50 / p95 per rank",
      [(f"histogram_quantile(0.5, sum by (rank, le) (rate(diag_step_device_seconds_bucket{sel()}[{RI}])))",
        "p50 rank {{rank}}"),
       (f"histogram_quantile(0.95, sum by (rank, le) (rate(diag_step_device_seconds_bucket{sel()}[{RI}])))",
        "p95 rank {{rank}}")],
      "s", description="The device's own step time, between timing events on the training stream at each step "
                       "boundary (CUDA or HIP ranks; empty on CPU ranks). Well under the step time: the device "
                       "waits for the host."),
    P("Data wait share per rank", [(share_of_step(f"diag_data_wait_seconds_total{sel()}"), "rank {{rank}}")],
      "percentunit", description="Share of step time spent waiting for the next batch (agent.loader()).",
      max=1),
    row("Where the time goes"),
    P("Bound class share over time",
      [(f"sum by (run, bound) (rate(diag_step_bound_total{sel()}[{RI}])) / on (run) group_left () "
        f"sum by (run) (rate(diag_steps_total{sel()}[{RI}]))", "{{bound}}")],
      "percentunit", description="Share of steps by verdict (data, host, comm, memory, compute).",
      stacked=True, max=1),
    P("Phase fractions",
      [(f"sum by (run, phase) (rate(diag_step_phase_seconds_total{sel()}[{RI}])) / on (run) group_left () "
        f"sum by (run) (rate(diag_step_duration_seconds_sum{sel()}[{RI}]))", "{{phase}}")],
      "percentunit", description="Share of step time attributed to each phase by the decision tree.",
      stacked=True, max=1),
    row("Stragglers over time"),
    P("Straggler episode at the end of the run",
      [(f"max by (run, kind) (diag_job_straggler_episode_active{sel()})", "{{kind}} {{run}}")],
      "short", description="1 while the job's last recorded steps are in a straggler episode of this kind "
                           "(persistent: one rank late for most of the run; rotating: the late rank moves; "
                           "transient: a burst), from the diagnosis (rank 0 at the report, or diag export).",
      width=8, max=1),
    P("Job time lost to stragglers",
      [(f"max by (run, kind) (diag_job_straggler_lost_seconds{sel()})", "{{kind}} {{run}}")],
      "s", "bargauge", "Time the job waited beyond its median rank in straggler episodes, by kind, from the "
                       "diagnosis.", 8),
    P("Profiler window recording",
      [(f"max by (run, rank) (diag_profiler_window_active{sel()})", "rank {{rank}}")],
      "short", description="1 while a profiler window records the rank's steps (scheduled, or requested with "
                           "diag top's p or RUN_DIR/profile.trigger).", width=8, max=1),
]

GPU = [
    row("GPU"),
    P("GPU utilization", [(f"diag_gpu_utilization_ratio{sel()}", "rank {{rank}} gpu {{gpu}}")],
      "percentunit", max=1),
    P("GPU memory used / total",
      [(f"diag_gpu_memory_used_bytes{sel()} / diag_gpu_memory_total_bytes{sel()}", "rank {{rank}}")],
      "percentunit", description="NVML's view, which includes PyTorch's cached but free blocks.", max=1),
    P("Peak allocated memory per step",
      [(f"diag_step_peak_memory_bytes{sel()}", "peak rank {{rank}}"),
       (f"diag_gpu_memory_total_bytes{sel()}", "capacity rank {{rank}}")], "bytes"),
    P("Power", [(f"diag_gpu_power_watts{sel()}", "rank {{rank}}")], "watt"),
    P("Energy per step",
      [(f"rate(diag_gpu_energy_joules_total{sel()}[{RI}]) / on (run, host, rank, local_rank, gpu) "
        f"rate(diag_steps_total{sel()}[{RI}])", "rank {{rank}}")], "joule"),
    P("Temperature", [(f"diag_gpu_temperature_celsius{sel()}", "rank {{rank}}")], "celsius"),
    P("SM clock", [(f"diag_gpu_sm_clock_hertz{sel()}", "rank {{rank}}")], "hertz"),
    P("Clock event reasons active",
      [(f"sum by (reason) (diag_gpu_clock_event_active{sel()})", "{{reason}}")], "short",
      description="Number of selected GPUs whose clocks are reduced, by reason (thermal, power cap, ...)."),
    P("PCIe throughput",
      [(f"sum by (rank, direction) (rate(diag_gpu_pcie_bytes_total{sel()}[{RI}]))",
        "rank {{rank}} {{direction}}")], "Bps"),
    P("NVLink throughput",
      [(f"sum by (rank, direction) (rate(diag_gpu_nvlink_bytes_total{sel()}[{RI}]))",
        "rank {{rank}} {{direction}}")], "Bps"),
    P("XID and ECC errors (last hour)",
      [(f"increase(diag_gpu_xid_errors_total{sel()}[1h])", "XID rank {{rank}}"),
       (f"increase(diag_gpu_ecc_errors_total{sel()}[1h])", "ECC rank {{rank}}")], "short"),
    P("GPUs", [(f"diag_gpu_info{sel()}", "")], "short", "table", "Model and UUID of each rank's GPU.", 12),
    row("Host"),
    P("Host CPU", [(f"diag_host_cpu_ratio{sel()}", "{{host}}"),
                   (f"diag_process_cpu_ratio{sel()}", "process rank {{rank}}"),
                   (f"diag_dataloader_workers_cpu_ratio{sel()}", "loader workers rank {{rank}}")],
      "percentunit", description="Host utilisation (0-1) and the training and DataLoader processes (cores)."),
    P("Host memory", [(f"diag_host_memory_used_bytes{sel()}", "used {{host}}"),
                      (f"diag_host_memory_total_bytes{sel()}", "total {{host}}"),
                      (f"diag_process_resident_memory_bytes{sel()}", "rss rank {{rank}}")], "bytes"),
    P("Disk I/O", [(f"max by (host, direction) (rate(diag_host_disk_bytes_total{sel()}[{RI}]))",
                    "{{host}} {{direction}}")], "Bps"),
    P("Network I/O", [(f"max by (host, direction) (rate(diag_host_network_bytes_total{sel()}[{RI}]))",
                       "{{host}} {{direction}}")], "Bps"),
    P("DataLoader workers", [(f"diag_dataloader_workers{sel()}", "rank {{rank}}")], "short"),
]

COMM = [
    row("Communication"),
    P("Exposed communication share per rank",
      [(share_of_step("diag_step_phase_seconds_total" + sel('phase="comm"')), "rank {{rank}}")],
      "percentunit", description="Share of step time spent in communication not hidden by computation.",
      max=1),
    P("Communication overlapped by computation", [(f"diag_comm_compute_overlap_ratio{sel()}", "rank {{rank}}")],
      "percentunit", description="From the last analysed profiler window.", max=1),
    P("Bus bandwidth (diag nccl)",
      [(f"max by (collective) (diag_nccl_bus_bandwidth_bytes_per_second{sel()})", "{{collective}}")],
      "Bps", "bargauge", "Average bus bandwidth per collective from the last `diag nccl` run "
                         "(nccl-tests busbw)."),
    P("NCCL findings", [(f"sum by (id) (diag_nccl_findings{sel()})", "{{id}}")], "short", "table",
      "Findings of the parsed NCCL logs (diag nccl-log)."),
    P("Profiler window findings", [(f"sum by (id) (diag_analysis_findings{sel()})", "{{id}}")], "short",
      "table", "Findings of the last analysed profiler window on each selected rank."),
]

EXPORTER = [
    row("Exporter health"),
    P("Targets up", [('sum by (job) (up{job=~"$job"})', "{{job}}")], "short", "stat",
      "Rank endpoints Prometheus reached in its last scrape.", 6, 4),
    P("Build", [(f"diag_build_info{sel()}", "")], "short", "table",
      "diag, Python and PyTorch versions per rank.", 18, 4),
    P("Scrape duration", [('scrape_duration_seconds{job=~"$job"}', "{{instance}}")], "s"),
    P("Series per endpoint", [('scrape_samples_scraped{job=~"$job"}', "{{instance}}")], "short"),
    P("Collect duration", [(f"diag_exporter_collect_duration_seconds{sel()}", "rank {{rank}}")], "s"),
    P("Scrapes per second", [(f"rate(diag_exporter_scrapes_total{sel()}[{RI}])", "rank {{rank}}")], "ops"),
    P("Records observed per second",
      [(f"sum by (kind) (rate(diag_exporter_observations_total{sel()}[{RI}]))", "{{kind}}")], "ops"),
    P("Exporter errors (last hour)",
      [(f"sum by (stage) (increase(diag_exporter_errors_total{sel()}[1h]))", "{{stage}}")], "short"),
]

DASHBOARDS = {
    "diag-training.json": ("diag-training", "diag: training overview", TRAINING),
    "diag-gpu.json": ("diag-gpu", "diag: GPU and host detail", GPU),
    "diag-communication.json": ("diag-communication", "diag: communication", COMM),
    "diag-exporter.json": ("diag-exporter", "diag: exporter health", EXPORTER),
}


def _variables() -> list:
    """The data source, then job, run, host and rank, each narrowing the next."""

    def query_var(name, label, metric="diag_build_info", extra=""):
        q = f"label_values({metric}{{{extra}}}, {label})" if extra else f"label_values({metric}, {label})"
        return (gdash.QueryVariable(name).label(name).datasource(DS)
                .query({"query": q, "refId": "PrometheusVariableQueryEditor-VariableQuery"})
                .refresh(gdash_m.VariableRefresh.ON_TIME_RANGE_CHANGED)
                .sort(gdash_m.VariableSort.NUMERICAL_ASC if name == "rank" else gdash_m.VariableSort.ALPHABETICAL_ASC)
                .multi(True).include_all(True).all_value(".*"))

    return [
        gdash.DatasourceVariable("DS_PROMETHEUS").label("Prometheus").type("prometheus"),
        query_var("job", "job"),
        query_var("run", "run", extra='job=~"$job"'),
        query_var("host", "host", extra='job=~"$job", run=~"$run"'),
        query_var("rank", "rank", extra='job=~"$job", run=~"$run", host=~"$host"'),
    ]


def _target(p: P, i: int, expr: str, legend: str):
    t = prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(chr(ord("A") + i)).datasource(DS)
    if p.kind == "table":
        t = t.format(prometheus_m.PromQueryFormat.TABLE).instant()
    return t


def _panel(p: P, pid: int):
    """One panel through the SDK's builder of its type: its options, units and queries are typed."""
    kind = {"timeseries": timeseries, "stat": stat, "table": table, "bargauge": bargauge}[p.kind]
    b = (kind.Panel().id(pid).title(p.title).description(p.description).datasource(DS)
         .span(p.width).height(p.height).unit(p.unit))
    for i, (expr, legend) in enumerate(p.targets):
        b = b.with_target(_target(p, i, expr, legend))
    if p.max is not None:
        b = b.min(0).max(p.max)
    if p.kind == "timeseries":
        b = (b.stacking(common.StackingConfig().mode(
                common_m.StackingMode.NORMAL if p.stacked else common_m.StackingMode.NONE).group("A"))
             .fill_opacity(30 if p.stacked else 0).line_width(1)
             .legend(common.VizLegendOptions().display_mode(common_m.LegendDisplayMode.LIST)
                     .placement(common_m.LegendPlacement.BOTTOM).show_legend(True))
             .tooltip(common.VizTooltipOptions().mode(common_m.TooltipDisplayMode.MULTI)
                      .sort(common_m.SortOrder.DESCENDING)))
    elif p.kind in ("stat", "bargauge"):
        b = b.reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        if p.kind == "stat":
            b = (b.color_mode(common_m.BigValueColorMode.VALUE).graph_mode(common_m.BigValueGraphMode.AREA)
                 .text_mode(common_m.BigValueTextMode.AUTO))
        else:
            b = b.orientation(common_m.VizOrientation.HORIZONTAL).display_mode(common_m.BarGaugeDisplayMode.GRADIENT)
    else:
        # One row per series with its labels as columns; the constant 1 of *_info is noise.
        b = b.show_header(True).with_transformation(gdash_m.DataTransformerConfig(
            id_val="organize", options={"excludeByName": {"Time": True, "__name__": True}}))
    return b


def dashboard(uid: str, title: str, items: list) -> dict:
    """The dashboard as Grafana's own SDK builds it (pinned to the Grafana 11 line); its types
    check every panel, query, unit and option, and its layout places the panels row by row."""
    b = (gdash.Dashboard(title).uid(uid).tags(["diag"]).timezone("browser").editable()
         .tooltip(gdash_m.DashboardCursorSync.CROSSHAIR).refresh("30s").time("now-1h", "now").version(1)
         .link(gdash.DashboardLink("diag dashboards").type(gdash_m.DashboardLinkType.DASHBOARDS)
               .tags(["diag"]).as_dropdown(True)))
    for v in _variables():
        b = b.with_variable(v)
    pid = 1
    for item in items:
        if isinstance(item, str):
            b = b.with_row(gdash.Row(item).id(pid))
        else:
            b = b.with_panel(_panel(item, pid))
        pid += 1
    return json.loads(JSONEncoder(sort_keys=True, indent=2).encode(b.build()))


# ---------------------------------------------------------------------------- alerts
@dataclass
class Alert:
    name: str
    quantity: str  # the expression whose value is compared; the live test requires it to return data
    op: str
    threshold: float
    for_: str
    severity: str
    summary: str
    description: str

    @property
    def expr(self) -> str:
        return f"{self.quantity} {self.op} {self.threshold:g}"


def alerts() -> list[Alert]:
    tree = load_tree()
    data_wait = tree.threshold("data_wait")
    exposed = tree.threshold("exposed_comm")
    mean5 = ("(sum by (run, host, rank) (rate(diag_step_duration_seconds_sum[5m])) / "
             "sum by (run, host, rank) (rate(diag_step_duration_seconds_count[5m])))")
    return [
        Alert("DiagStepStalled", "time() - max by (run, host, rank) (diag_last_step_timestamp_seconds)",
              ">", 300, "1m", "critical", "Rank {{ $labels.rank }} of run {{ $labels.run }} has not finished a step",
              "No step ended on rank {{ $labels.rank }} ({{ $labels.host }}) for {{ $value | humanizeDuration }}: "
              "a hang (collective waiting for a dead peer, deadlock, stuck I/O) or a very slow step."),
        Alert("DiagStraggler", f"{mean5} / on (run) group_left () quantile by (run) (0.5, {mean5})",
              ">", 1.2, "10m", "warning", "Rank {{ $labels.rank }} is a straggler in run {{ $labels.run }}",
              "Rank {{ $labels.rank }} ({{ $labels.host }}) takes {{ $value | printf \"%.2f\" }}x the median "
              "step time; every rank of a synchronous job waits for it. Check its GPU clocks, data input "
              "and host load."),
        Alert("DiagGpuXidError", "increase(diag_gpu_xid_errors_total[10m])", ">", 0, "0m", "critical",
              "New XID error on {{ $labels.host }} GPU {{ $labels.gpu }}",
              "The driver reported {{ $value }} new XID error(s) on the GPU of rank {{ $labels.rank }}; "
              "see the kernel log (dmesg) for the XID code."),
        Alert("DiagGpuThermalThrottling",
              "max by (run, host, rank, gpu) (avg_over_time("
              "diag_gpu_clock_event_active{reason=~\"sw_thermal|hw_thermal\"}[5m]))",
              ">", 0.5, "5m", "warning", "GPU {{ $labels.gpu }} on {{ $labels.host }} is thermally throttled",
              "The clocks of rank {{ $labels.rank }}'s GPU were reduced for thermal reasons more than half "
              "of the last 5 minutes; check cooling and airflow."),
        Alert("DiagOutOfMemory", "increase(diag_oom_errors_total[10m])", ">", 0, "0m", "critical",
              "Out-of-memory error on rank {{ $labels.rank }} of run {{ $labels.run }}",
              "The agent caught an out-of-memory error in the training loop. Lower the batch size, enable "
              "activation checkpointing, or shard the model (FSDP/ZeRO)."),
        Alert("DiagGpuMemoryNearlyFull",
              "max_over_time(diag_step_peak_memory_bytes[5m]) / on (run, host, rank, local_rank, gpu) "
              "diag_gpu_memory_total_bytes",
              ">", 0.95, "5m", "warning", "Rank {{ $labels.rank }} is close to running out of GPU memory",
              "Peak allocated memory per step reached {{ $value | humanizePercentage }} of the GPU's capacity; "
              "a longer sequence or a fragmented allocator will end in an out-of-memory error."),
        Alert("DiagCommShareHigh",
              "sum by (run, host, rank) (rate(diag_step_phase_seconds_total{phase=\"comm\"}[5m])) / "
              "sum by (run, host, rank) (rate(diag_step_duration_seconds_sum[5m]))",
              ">", exposed, "10m", "warning", "Exposed communication is high on rank {{ $labels.rank }}",
              "{{ $value | humanizePercentage }} of the step is communication not hidden by computation "
              "(the decision tree's comm-bound threshold). Overlap gradients with the backward pass, "
              "raise the bucket size, or check the interconnect with diag nccl."),
        Alert("DiagDataWaitHigh",
              "sum by (run, host, rank) (rate(diag_data_wait_seconds_total[5m])) / "
              "sum by (run, host, rank) (rate(diag_step_duration_seconds_sum[5m]))",
              ">", data_wait, "10m", "warning", "Rank {{ $labels.rank }} waits for data",
              "{{ $value | humanizePercentage }} of the step is spent waiting for the next batch (the "
              "decision tree's data-bound threshold). Raise num_workers, pin memory, prefetch."),
    ]


def alert_rules() -> dict:
    rules = []
    for a in alerts():
        rules.append({
            "alert": a.name, "expr": a.expr, "for": a.for_,
            "labels": {"severity": a.severity},
            "annotations": {"summary": a.summary, "description": a.description},
        })
    return {"groups": [{"name": "diag", "rules": rules}]}


# ---------------------------------------------------------------------------- checks and output
_NAME = re.compile(r"\b(diag_[a-z0-9_]+)")


def unknown_metrics(expr: str) -> list[str]:
    known = series_names()
    return [n for n in _NAME.findall(expr) if n not in known]


def all_expressions() -> list[tuple[str, str]]:
    """(where, expression) for every dashboard panel target and alert rule."""
    out = []
    for fname, (_uid, _title, items) in DASHBOARDS.items():
        for p in items:
            if isinstance(p, P):
                out += [(f"{fname}: {p.title}", e) for e, _ in p.targets]
    out += [(f"alerts.yml: {a.name}", a.expr) for a in alerts()]
    return out


def render_all() -> dict[str, str]:
    files = {}
    for fname, (uid, title, items) in DASHBOARDS.items():
        files[fname] = json.dumps(dashboard(uid, title, items), indent=2) + "\n"
    header = ("# Prometheus alert rules for diag. Generated by dashboards/generate.py from the metric\n"
              "# table and the decision tree's thresholds; unit tests: promtool test rules alerts_test.yml\n")
    files["alerts.yml"] = header + yaml.safe_dump(alert_rules(), sort_keys=False, width=100)
    files["METRICS.md"] = docs.render()
    return files


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE), help="output directory (default: dashboards/)")
    args = ap.parse_args(argv)
    bad = [(w, n) for w, e in all_expressions() for n in unknown_metrics(e)]
    if bad:
        for where, name in bad:
            print(f"{where}: {name} is not in the metric table", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in render_all().items():
        (out / name).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
