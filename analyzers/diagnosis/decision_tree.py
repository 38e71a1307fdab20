"""Evaluates the bottleneck decision tree in `decision_tree.toml`.

The tree is data: nodes ask one question of one measurement against one threshold.
`evaluate` returns the verdict, the path walked (value and threshold at each node) and
the fixes; `advise` runs the advisory rules. Both are pure functions of their inputs.
"""

from __future__ import annotations

import math
import operator
import tomllib
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from diag.analyzers.analysis_types import Finding
from diag.analyzers.model import (  # noqa: F401 (the names the diagnosis reads through the tree)
    BOUNDS,
    CLASSES,
    MEASUREMENTS,
    PEER,
    FactSettings,
    Measurement,
    derive,
    metric_text,
    share_ratios,
)

DEFAULT_TREE = Path(__file__).with_name("decision_tree.toml")

_OPS = {">=": operator.ge, ">": operator.gt, "<": operator.lt, "<=": operator.le}


class TreeError(ValueError):
    """The tree or a threshold override is malformed."""


@dataclass(frozen=True)
class Tree:
    start: str
    thresholds: dict
    nodes: dict
    verdicts: dict
    advisories: list = field(default_factory=list)
    what_if: tuple = ()  # the what-if changes: the standard ones, then the config file's
    # The fixes (by their start) and what-if changes that pay only where lower precision runs
    # faster: withheld on a CPU without bf16 matrix units (diagnosis/precision.py).
    needs_half_precision: dict = field(default_factory=dict)

    @cached_property
    def walker(self) -> Walker:
        """The tree's Walker for single steps, made once: its path signatures are as many as
        the tree has distinct paths, so it stays small however many steps it walks."""
        return Walker(self)

    @property
    def facts(self) -> FactSettings:
        """What the analysis measures by under this tree: its what-if changes and the
        thresholds that set how a fact is measured."""
        return FactSettings.of(self.thresholds, self.what_if)

    def threshold(self, ref) -> float:
        if isinstance(ref, (int, float)):
            return float(ref)
        if ref not in self.thresholds:
            raise TreeError(f"unknown threshold {ref!r}")
        return float(self.thresholds[ref])


# A run directory records the settings its agent resolved (thresholds and what-if changes),
# so that every later analysis of the run judges by them.
SETTINGS_SCHEMA = "diag.tree_settings/1"


def settings(tree: Tree) -> dict:
    """What a user can set in a tree, resolved: its thresholds and what-if changes."""
    return {"schema": SETTINGS_SCHEMA, "thresholds": dict(tree.thresholds), "what_if": [dict(c) for c in tree.what_if]}


def load_tree(path: str | Path | None = None, overrides: dict | None = None, recorded: dict | None = None) -> Tree:
    """Load the default tree, then the settings a run recorded, then a config file's
    [thresholds] and [[what_if]], then explicit overrides: each later one wins."""
    with open(DEFAULT_TREE, "rb") as f:
        doc = tomllib.load(f)
    thresholds = dict(doc["thresholds"])
    what_if = [check_change(c, DEFAULT_TREE.name) for c in doc.get("what_if", [])]
    if recorded is not None:
        thresholds, what_if = _with_recorded(thresholds, what_if, recorded)
    if path is not None:
        config = read_config(Path(path))  # read once: its thresholds and its what-if changes
        thresholds.update(_config_thresholds(config, path))
        what_if = _with_config_changes(what_if, config, path)
    for name, value in (overrides or {}).items():
        if name not in thresholds:
            raise TreeError(f"unknown threshold {name!r}; known: {', '.join(sorted(thresholds))}")
        thresholds[name] = float(value)
    _check_metrics(doc)
    return Tree(
        start=doc["start"],
        thresholds=thresholds,
        nodes=doc["nodes"],
        verdicts=doc["verdicts"],
        advisories=doc.get("advisories", []),
        needs_half_precision=doc.get("needs_half_precision", {}),
        what_if=tuple(what_if),
    )


def _with_recorded(thresholds: dict, what_if: list, recorded: dict) -> tuple[dict, list]:
    """The recorded settings over the defaults. Names this version does not know (a run
    recorded by another version) are passed over; a malformed record is an error."""
    if not isinstance(recorded, dict) or recorded.get("schema") != SETTINGS_SCHEMA:
        raise TreeError(f"the run's recorded decision-tree settings are not a {SETTINGS_SCHEMA} document")
    table = recorded.get("thresholds")
    if not isinstance(table, dict):
        raise TreeError("the run's recorded decision-tree settings have no thresholds table")
    out = dict(thresholds)
    for name, value in table.items():
        if name in out:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise TreeError(f"the run's recorded threshold {name!r} is not a finite number")
            out[name] = float(value)
    changes = {c["id"]: c for c in what_if}
    for entry in recorded.get("what_if") or []:
        c = check_change(entry, "the run's recorded decision-tree settings")
        changes[c["id"]] = c
    return out, list(changes.values())


def _check_metrics(doc: dict) -> None:
    for where, items in (("node", doc["nodes"].items()), ("advisory", ((a.get("id"), a) for a in doc.get("advisories", [])))):
        for name, item in items:
            if item.get("metric") not in MEASUREMENTS:
                raise TreeError(f"{where} {name!r} asks about {item.get('metric')!r}, which is not a registered "
                                f"measurement (decision_tree.MEASUREMENTS)")


def read_config(path: Path) -> dict:
    """A diag config file (TOML, or YAML by its suffix) as a dict. One reader for every
    table in it: the tree's [thresholds] here, the agent's [agent.*] in diag.config."""
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            doc = yaml.safe_load(path.read_text()) or {}
        else:
            with open(path, "rb") as f:
                doc = tomllib.load(f)
    except FileNotFoundError:
        raise TreeError(f"{path}: config file not found") from None
    except Exception as exc:
        raise TreeError(f"{path}: not a readable TOML/YAML config ({exc})") from None
    if not isinstance(doc, dict):
        raise TreeError(f"{path}: not a table of settings")
    return doc


# The parts of a step a what-if change may scale (diag.analyzers.whatif replays them).
WHAT_IF_PARTS = ("data", "host", "launch", "sync", "slack", "comm", "memory", "compute", "straggler")
# What a cause's change can remove, and the part that time lies in (measured per step by
# diag.analyzers.trace.removals).
REMOVALS = {"elementwise_chain": "memory", "fp32_math": "compute", "half_precision_matrix_ops": "compute",
            "host_sync_points": "host", "allocator_calls": "host", "cpu_work": "host",
            "slow_bandwidth_kernels": "memory", "exposed_collective": "comm", "pageable_copies": "memory",
            "python_gaps": "host", "accumulated_all_reduce": "comm"}


def check_change(entry, where: str) -> dict:
    """A [[what_if]] entry, checked: {"id", "description", "scale", "scope", "fixes"} (and
    "remove", for a change that removes a cause's measured time)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("id"), str) or not entry["id"].strip():
        raise TreeError(f"{where}: every [[what_if]] entry needs an id")
    cid = entry["id"]
    if "remove" in entry:
        return _removal_change(entry, where)
    scale = entry.get("scale")
    if not isinstance(scale, dict) or not scale:
        raise TreeError(f"{where}: what_if {cid!r} needs scale = {{ part = factor, ... }}")
    out = {}
    for part, f in scale.items():
        if part not in WHAT_IF_PARTS:
            raise TreeError(f"{where}: what_if {cid!r}: unknown part {part!r}; known: {', '.join(WHAT_IF_PARTS)}")
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f < math.inf:
            raise TreeError(f"{where}: what_if {cid!r}: the factor of {part} must be a number >= 0")
        out[part] = float(f)
    scope = "job" if "straggler" in out else "rank"
    if "straggler" in out and len(out) > 1:
        raise TreeError(f"{where}: what_if {cid!r}: straggler acts on the job and cannot be mixed with other parts")
    fixes = entry.get("fixes")
    return {"id": cid, "description": str(entry.get("description") or cid), "scale": out, "scope": scope,
            "fixes": fixes if fixes in CLASSES else None, **_steps(entry, where)}


def _steps(entry: dict, where: str) -> dict:
    """{"steps": n} where the entry limits the device-graph steps it is replayed on (each replay
    of a device step costs milliseconds), else {}."""
    if "steps" not in entry:
        return {}
    n = entry["steps"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise TreeError(f"{where}: what_if {entry['id']!r}: steps must be a whole number >= 1")
    return {"steps": n}


def _removal_change(entry: dict, where: str) -> dict:
    """A change that removes what one cause costs: its part is scaled step by step."""
    cid, what = entry["id"], entry.get("remove")
    if what not in REMOVALS:
        raise TreeError(f"{where}: what_if {cid!r}: remove must be one of {', '.join(REMOVALS)}")
    nominal = {REMOVALS[what]: 0.0}
    if "scale" in entry and entry["scale"] != nominal:  # a recorded entry carries its nominal scale
        raise TreeError(f"{where}: what_if {cid!r}: give scale or remove, not both")
    fixes = entry.get("fixes")
    # The nominal scale says which part the change acts on (a part absent from the step: no prediction).
    return {"id": cid, "description": str(entry.get("description") or cid), "scale": nominal,
            "remove": what, "scope": "rank", "fixes": fixes if fixes in CLASSES else None, **_steps(entry, where)}


def _with_config_changes(changes: list, config: dict, path) -> list:
    table = config.get("what_if", [])
    if not isinstance(table, list):
        raise TreeError(f"{path}: what_if must be a list of [[what_if]] entries")
    out = {c["id"]: c for c in changes}
    for entry in table:
        c = check_change(entry, str(path))
        out[c["id"]] = c  # a config entry with a standard id replaces it
    return list(out.values())


def _config_thresholds(config: dict, path) -> dict:
    table = config.get("thresholds", {})
    if not isinstance(table, dict):
        raise TreeError(f"{path}: [thresholds] must be a table of name = number")
    try:
        return {str(k): float(v) for k, v in table.items()}
    except (TypeError, ValueError):
        raise TreeError(f"{path}: every threshold must be a number") from None


def parse_overrides(items: list[str] | None) -> dict:
    """['data_wait=0.3', ...] from the CLI into a dict."""
    out = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError
            out[name.strip()] = float(value)
        except ValueError:
            raise TreeError(f"--threshold takes NAME=NUMBER, got {item!r}") from None
    return out


def _nan(v) -> bool:
    return isinstance(v, float) and math.isnan(v)


class Walker:
    """The one evaluator of the tree: its walk over columns of measurements, one row per step.
    Rows that answer alike move together, so a run of many steps costs a few array
    comparisons per node; one step (`walk_one`, in the agent's step loop) takes the same
    nodes, answers and branches without arrays. Each row ends with a path signature, a tuple
    of (node, answer) kept once per distinct path, and the verdict its leaf names."""

    def __init__(self, tree: Tree):
        self.tree = tree
        self._ids: dict[tuple, int] = {(): 0}
        self.sigs: list[tuple] = [()]
        self._steps: dict[tuple, int] = {}  # (parent id, node, answer) -> child id
        # Each node's comparison, resolved once.
        self._test = {nid: (n["metric"], _OPS[n["op"]], tree.threshold(n["threshold"])) for nid, n in tree.nodes.items()}

    def _child(self, pid: int, node: str, answer: str) -> int:
        step = (pid, node, answer)
        sid = self._steps.get(step)
        if sid is None:
            key = (*self.sigs[pid], (node, answer))
            sid = self._ids.get(key)
            if sid is None:
                sid = self._ids[key] = len(self.sigs)
                self.sigs.append(key)
            self._steps[step] = sid
        return sid

    def guessed(self, sid: int) -> bool:
        """Whether the path went through an unknown core measurement (its verdict is a guess)."""
        return any(a == "unknown" and self.tree.nodes[nd]["metric"] in CORE_METRICS for nd, a in self.sigs[sid])

    def walk_one(self, m: dict, force: dict | None = None) -> tuple[int, str]:
        """(path signature id, verdict) of one set of measurements, as `walk` gives a row."""
        tree = self.tree
        sid, node_id = 0, tree.start
        for _ in range(len(tree.nodes) + 1):
            node = tree.nodes[node_id]
            forced = (force or {}).get(node_id)
            if forced is not None:
                answer = branch = forced[0]
            else:
                metric, op, threshold = self._test[node_id]
                value = m.get(metric)
                if value is None or value != value:  # unmeasured, or NaN
                    answer, branch = "unknown", "no"
                else:
                    answer = branch = "yes" if op(value, threshold) else "no"
            sid = self._child(sid, node_id, answer)
            target = node[branch]
            if target.startswith("verdict:"):
                return sid, target.split(":", 1)[1]
            node_id = target
        raise TreeError("decision tree has a cycle")

    def walk(self, cols: dict, n: int, force: dict | None = None) -> tuple[np.ndarray, list]:
        """(path signature id per row, verdict per row). A column missing, or NaN in a row,
        answers "unknown" and takes the "no" branch; `force` sets a node's answer for every row."""
        tree = self.tree
        sig = np.zeros(n, dtype=np.int64)
        verdict: list = [None] * n
        groups = [(tree.start, 0, np.arange(n))]
        for _ in range(len(tree.nodes) + 1):
            nxt_groups = []
            for node_id, pid, rows in groups:
                node = tree.nodes[node_id]
                forced = (force or {}).get(node_id)
                if forced is not None:
                    branches = [(forced[0], np.ones(len(rows), dtype=bool), forced[0])]
                else:
                    metric, op, threshold = self._test[node_id]
                    col = cols.get(metric)
                    values = col[rows] if col is not None else np.full(len(rows), np.nan)
                    known = ~np.isnan(values)
                    hit = np.zeros(len(rows), dtype=bool)
                    hit[known] = op(values[known], threshold)
                    branches = [("unknown", ~known, "no"), ("yes", known & hit, "yes"), ("no", known & ~hit, "no")]
                for answer, mask, branch in branches:
                    sub = rows[mask]
                    if not len(sub):
                        continue
                    child = self._child(pid, node_id, answer)
                    target = node[branch]
                    if target.startswith("verdict:"):
                        sig[sub] = child
                        b = target.split(":", 1)[1]
                        for r in sub.tolist():
                            verdict[r] = b
                    else:
                        nxt_groups.append((target, child, sub))
            groups = nxt_groups
            if not groups:
                return sig, verdict
        raise TreeError("decision tree has a cycle")


def evaluate(measurements: dict, tree: Tree, force: dict | None = None) -> dict:
    """Walk the tree for one set of measurements (the Walker on one row). An unmeasured metric
    answers 'unknown' and takes the 'no' branch.

    force: node id -> (answer "yes"/"no", reason) for nodes whose answer is set from
    outside the measurements (the other side of a borderline node, a wait that cannot be
    handed to a peer); the path records the reason.
    """
    m = derive(measurements)
    walker = tree.walker
    sid, bound = walker.walk_one(m, force)
    path = []
    for node_id, answer in walker.sigs[sid]:
        node = tree.nodes[node_id]
        threshold = walker._test[node_id][2]
        path.append({
            "node": node_id,
            "question": node["question"].format(threshold=threshold),
            "metric": node["metric"],
            "value": m.get(node["metric"]),
            "op": node["op"],
            "threshold": threshold,
            "answer": answer,
        })
        if force and node_id in force:
            path[-1]["forced"] = force[node_id][1]
    v = tree.verdicts[bound]
    return {"bound": bound, "title": v["title"], "summary": v["summary"], "path": path, "fixes": list(v["fixes"])}


# A tree answer of "unknown" on one of these means the verdict would be a guess.
CORE_METRICS = frozenset({"data_share", "busy_share", "data_fraction_of_idle", "comm_share", "memory_to_compute"})


def verdict_from(measurements: dict, tree, force: dict | None = None) -> dict:
    """Evaluate the tree; a verdict reached through an unknown core measurement is withheld."""
    v = evaluate(measurements, tree, force)
    guessed = any(n["answer"] == "unknown" and n["metric"] in CORE_METRICS for n in v["path"])
    return {"bound": None if guessed else v["bound"], "path": v["path"], "fixes": [] if guessed else v["fixes"]}


def advise(measurements: dict, tree: Tree, bound: str | None = None, source: str | None = None) -> list[Finding]:
    """Advisory findings whose rule fires on the measurements given (beside verdict `bound`);
    `source` (e.g. "trace") is recorded in each finding's evidence."""
    m = derive(measurements)
    out: list[Finding] = []
    for rule in tree.advisories:
        if bound is not None and rule.get("unless_bound") == bound:
            continue
        value = m.get(rule["metric"])
        if value is None:
            continue
        threshold = tree.threshold(rule["threshold"])
        if _OPS[rule["op"]](value, threshold):
            out.append(
                {
                    "id": rule["id"],
                    "severity": rule["severity"],
                    "message": rule["message"].format(value=value, threshold=threshold),
                    "advice": rule["advice"],
                    "evidence": {rule["metric"]: value, "threshold": threshold,
                                 **({"source": source} if source else {})},
                }
            )
    return out
