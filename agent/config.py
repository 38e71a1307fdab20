"""The agent's configuration: one typed object, from defaults, a file, the environment and arguments.

    AgentConfig.resolve(config_file=None, env=os.environ, **options) -> AgentConfig

Each value comes from the first of these that sets it, highest first:
  1. keyword arguments, by their flat names (`diag.Agent(every=500, export=False)`);
  2. environment variables `DIAG_<SECTION>_<FIELD>` (`DIAG_PROFILER_EVERY=500`), plus the
     older names `DIAG_EXPORTER=0` (the endpoint off) and `DIAG_RUN_DIR`, `DIAG_RUN_ID`,
     `DIAG_EXPORTER_PORT`, `DIAG_EXPORTER_BIND`, which already follow the rule;
  3. the config file (`config_file=` or `DIAG_CONFIG`), the same TOML or YAML file that
     `diag analyze --config` reads: tables `[agent.<section>]`, beside `[thresholds]`;
  4. the defaults below.
`sources` says where each effective value came from; `diag config --show` prints it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from diag.collectors import profiler_windows as pw
from diag.errors import DiagInputError

_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


def _f(default, doc: str, flat: str | None = None, env: bool = True):
    """A field with its one-line doc and the flat keyword name `diag.Agent` takes for it;
    env=False: no environment variable sets it."""
    return field(default=default, metadata={"doc": doc, "flat": flat, "env": env})


@dataclass
class ProfilerConfig:
    enabled: bool = _f(True, "profile scheduled torch.profiler windows", "profile")
    skip_first: int = _f(pw.SKIP_FIRST, "steps before the first window", "skip_first")
    warmup: int = _f(pw.WARMUP, "profiler warm-up steps of each window", "warmup")
    active: int = _f(pw.ACTIVE, "recorded steps of each window", "active")
    every: int = _f(pw.EVERY, "a window starts every this many steps", "every")
    record_shapes: bool = _f(True, "record operator input shapes (for FLOPs and the roofline)", "record_shapes")
    with_flops: bool = _f(True, "let the profiler estimate FLOPs", "with_flops")
    profile_memory: bool = _f(False, "record memory allocations in windows", "profile_memory")
    stack_windows: int = _f(1, "the first windows that record Python call stacks (the causes name their call "
                               "sites; the stack costs that window more overhead)", "stack_windows")
    trace_budget_bytes: int = _f(1 << 30, "per-rank size budget of saved traces (oldest deleted)",
                                 "trace_budget_bytes")
    analyse_during_run: bool = _f(True, "analyse each window as it is saved (False: at exit)",
                                  "analyse_during_run")
    analysis_wait_s: float = _f(60.0, "at exit, how long to wait for window analyses", "analysis_wait_s")
    export_in_child: bool = _f(True, "let a forked process write traces when a thread (which holds the GIL) "
                                     "would stall training longer", "export_in_child")
    on_demand: bool = _f(False, "take profiler windows asked for over the metrics endpoint (POST /profile, from "
                                "this node or with DIAG_EXPORTER_TOKEN); off unless set: anyone who can reach the "
                                "port could ask", "profile_on_demand")
    on_demand_interval_s: float = _f(60.0, "at most one window asked for over the endpoint in this many seconds",
                                     "profile_on_demand_interval_s")
    on_demand_max: int = _f(10, "at most this many windows asked for over the endpoint in a run",
                            "profile_on_demand_max")
    on_demand_max_ahead: int = _f(10_000, "the furthest step past the current one a window may be asked for",
                                  "profile_on_demand_max_ahead")


@dataclass
class SamplingConfig:
    enabled: bool = _f(True, "sample device and host metrics in a background thread", "sampling")
    interval_s: float = _f(1.0, "seconds between samples", "sample_interval_s")
    device: int | str | None = _f("auto", "device index to sample: auto, none, or a number", "device")


@dataclass
class ExporterConfig:
    enabled: bool = _f(True, "serve Prometheus metrics (port base + LOCAL_RANK)", "export")
    port: int | None = _f(None, "port base (default 9870)", "export_port_base")
    bind: str | None = _f(None, "address to listen on (default all interfaces)", "export_bind")
    linger_s: float = _f(0.0, "keep serving this long after a completed run", "export_linger_s")


@dataclass
class NcclConfig:
    log: bool = _f(True, "route NCCL_DEBUG=INFO logs into the rank's folder", "nccl_log")
    coll: bool = _f(False, "add the COLL subsystem to NCCL_DEBUG_SUBSYS", "nccl_coll")


@dataclass
class ReportConfig:
    enabled: bool = _f(True, "rank 0 writes the job report at exit", "report")
    wait_s: float = _f(120.0, "how long rank 0 waits for its peers before the report", "report_wait_s")
    flops_per_sample: float | None = _f(None, "model FLOPs per sample, for MFU", "flops_per_sample")
    flops_per_token: float | None = _f(None, "model FLOPs per token, for MFU", "flops_per_token")
    mfu_dtype: str | None = _f(None, "dtype of the device peak for MFU (bf16, fp16, tf32, fp32)", "mfu_dtype")


@dataclass
class RunConfig:
    dir: str | None = _f(None, "run directory (default runs/<script>); an earlier run is never overwritten",
                         "run_dir")
    # DIAG_RUN_ID is the launcher-level id that `diag run` and the demo give their ranks
    # (read by the run writer as such), not this user-chosen one.
    id: str | None = _f(None, "run id shared by all ranks (default: from the launcher)", "run_id", env=False)
    overwrite: bool = _f(False, "reuse a run directory that holds an earlier run", "overwrite")
    heartbeat_s: float = _f(5.0, "how often rank.json is refreshed", "heartbeat_s")
    flush_s: float = _f(1.0, "how often buffered records are appended to the run directory (what a rank "
                             "killed without warning loses)", "flush_s")
    live_s: float = _f(1.0, "how often live.json (the last steps, for diag top) is rewritten; 0: never", "live_s")
    verbose: bool = _f(True, "print the agent's messages to stderr", "verbose")


SECTIONS = {"profiler": ProfilerConfig, "sampling": SamplingConfig, "exporter": ExporterConfig,
            "nccl": NcclConfig, "report": ReportConfig, "run": RunConfig}
# Flat keyword name -> (section, field).
FLAT = {f.metadata["flat"]: (s, f.name) for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
# Older variable names, kept with their meaning (DIAG_EXPORTER=0 turns the endpoint off).
ENV_ALIASES = {"DIAG_EXPORTER": ("exporter", "enabled")}


def env_name(section: str, name: str) -> str | None:
    f = next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == name)
    return f"DIAG_{section}_{name}".upper() if f.metadata["env"] else None


@dataclass
class AgentConfig:
    """Every setting of `diag.Agent`, grouped; see the module docstring for where values come from."""

    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    exporter: ExporterConfig = field(default_factory=ExporterConfig)
    nccl: NcclConfig = field(default_factory=NcclConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    run: RunConfig = field(default_factory=RunConfig)
    thresholds: dict = field(default_factory=dict)  # decision-tree overrides, beside the file's [thresholds]
    config_file: str | None = None
    sources: dict = field(default_factory=dict)  # "section.field" -> where its value came from

    @classmethod
    def resolve(cls, config_file=None, env: Mapping[str, str] | None = None, thresholds: dict | None = None,
                **options) -> AgentConfig:
        """Defaults, then the config file, then the environment, then keyword arguments."""
        env = os.environ if env is None else env
        unknown = sorted(set(options) - set(FLAT))
        if unknown:
            raise TypeError(f"unknown agent option(s) {', '.join(unknown)}; known: {', '.join(sorted(FLAT))}")
        cfg = cls()
        path = config_file if config_file is not None else (env.get("DIAG_CONFIG") or None)
        if path is not None:
            cfg.config_file = str(path)
            for (section, name), value in read_file(Path(path)).items():
                cfg._set(section, name, value, f"file {path}")
        for var, (section, name) in _env_names().items():
            raw = env.get(var)
            if raw is not None and raw.strip() != "":
                cfg._set(section, name, _parse(raw, cls._type(section, name), var), f"env {var}")
        for flat, value in options.items():
            section, name = FLAT[flat]
            cfg._set(section, name, value, "argument")
        if thresholds:
            cfg.thresholds = dict(thresholds)
        return cfg

    @staticmethod
    def _type(section: str, name: str) -> str:
        return next(str(f.type) for f in dataclasses.fields(SECTIONS[section]) if f.name == name)

    def _set(self, section: str, name: str, value, source: str) -> None:
        setattr(getattr(self, section), name, value)
        self.sources[f"{section}.{name}"] = source

    def source(self, section: str, name: str) -> str:
        return self.sources.get(f"{section}.{name}", "default")

    def to_dict(self) -> dict:
        """The settings by section (what the run directory's manifest records)."""
        out: dict[str, object] = {s: dataclasses.asdict(getattr(self, s)) for s in SECTIONS}
        out["thresholds"] = dict(self.thresholds)
        out["config_file"] = self.config_file
        return out

    def rows(self) -> list[dict]:
        """Every setting with its value, environment variable, source and doc (for `diag config --show`)."""
        out = []
        for section, cls in SECTIONS.items():
            for f in dataclasses.fields(cls):
                out.append({"section": section, "name": f.name, "value": getattr(getattr(self, section), f.name),
                            "env": env_name(section, f.name), "argument": f.metadata["flat"],
                            "source": self.source(section, f.name), "doc": f.metadata["doc"]})
        return out


def _env_names() -> dict[str, tuple[str, str]]:
    names = {var: (s, f.name) for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)
             if (var := env_name(s, f.name)) is not None}
    return {**ENV_ALIASES, **names}


def _parse(raw: str, typ: str, where: str):
    """A setting from text (an environment variable), by the field's declared type."""
    text = raw.strip()
    if typ == "bool":
        if text.lower() in _ON:
            return True
        if text.lower() in _OFF:
            return False
        raise DiagInputError(f"{where}={raw!r}: expected one of {', '.join(_ON + _OFF)}")
    if "None" in typ and text.lower() in ("none", "null"):
        return None
    if typ.startswith("int | str"):  # the sampled device: auto, none or an index
        return int(text) if text.isdigit() else text
    try:
        if typ.startswith("int"):
            return int(text)
        if typ.startswith("float"):
            return float(text)
    except ValueError:
        kind = "a whole number" if typ.startswith("int") else "a number"
        raise DiagInputError(f"{where}={raw!r}: expected {kind}") from None
    return text


def _check_type(value, typ: str, where: str):
    """A setting from a file, checked against the field's declared type (TOML/YAML are typed)."""
    if "None" in typ and (value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null"))):
        return None
    ok = {"bool": lambda v: isinstance(v, bool),
          "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          "str": lambda v: isinstance(v, str)}
    kinds = [k.strip() for k in typ.split("|") if k.strip() != "None"]
    if any(ok[k](value) for k in kinds):
        return float(value) if kinds == ["float"] else value
    raise DiagInputError(f"{where} = {value!r}: expected {' or '.join(kinds)}")


def read_file(path: Path) -> dict[tuple[str, str], object]:
    """The `[agent.<section>]` settings of a TOML or YAML config file, checked."""
    from diag.analyzers.diagnosis.decision_tree import TreeError, read_config

    try:
        doc = read_config(path)
    except TreeError as exc:  # its message starts with the path
        raise DiagInputError(str(exc)) from None
    agent = doc.get("agent", {})
    if not isinstance(agent, dict):
        raise DiagInputError("[agent] must be a table of sections", source=str(path))
    out = {}
    for section, table in agent.items():
        if section not in SECTIONS:
            raise DiagInputError(f"unknown section [agent.{section}]; known: {', '.join(SECTIONS)}",
                                 source=str(path))
        if not isinstance(table, dict):
            raise DiagInputError(f"[agent.{section}] must be a table", source=str(path))
        fields = {f.name: str(f.type) for f in dataclasses.fields(SECTIONS[section])}
        for name, value in table.items():
            if name not in fields:
                raise DiagInputError(f"unknown key {name!r} in [agent.{section}]; known: {', '.join(fields)}",
                                     source=str(path))
            try:
                out[(section, name)] = _check_type(value, fields[name], f"[agent.{section}] {name}")
            except DiagInputError as exc:
                raise DiagInputError(str(exc), source=str(path)) from None
    return out
