"""Probe-once, switch-off-on-failure bookkeeping shared by the device and host collectors.

Each collector declares its metrics as a table of ``Metric(name, read, probe)``. At start
every metric is probed once (its optional setup, then one read into a scratch record);
the unsupported ones are switched off and summarised in one log line. Afterwards
``read_into`` asks only the enabled ones; a metric that raises is switched off alone,
logged once, and the rest of the record is still filled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

Log = Callable[[str], None]


class NotAvailable(Exception):
    """A library answered, but with its 'not available' marker (amdsmi's "N/A", for instance)."""


@dataclass(frozen=True)
class Metric:
    name: str
    read: Callable[[dict], None]  # fills its keys of the record
    probe: Callable[[], None] | None = None  # one-time setup before the first read


def describe_error(e: BaseException) -> str:
    name = type(e).__name__
    try:
        text = " ".join(str(e).split())
    except Exception:
        text = ""
    return f"{name}: {text}" if text and text != name else name


class MetricSet:
    """A collector's metrics with their on/off state. Subclasses define ``table()``."""

    source = "metrics"  # prefix of log lines

    def __init__(self, log: Log):
        self.log = log
        self.enabled: list[Metric] = []
        self.unsupported: dict[str, str] = {}

    def table(self) -> list[Metric]:
        raise NotImplementedError

    def probe(self, subject: str = "") -> None:
        scratch: dict = {}
        for metric in self.table():
            try:
                if metric.probe is not None:
                    metric.probe()
                metric.read(scratch)
            except Exception as e:
                self.unsupported[metric.name] = describe_error(e)
                continue
            self.enabled.append(metric)
        if self.unsupported:
            where = f" on {subject}" if subject else ""
            detail = ", ".join(f"{k} ({v})" for k, v in self.unsupported.items())
            self.log(f"{self.source}: not supported{where}, switched off: {detail}")

    def read_into(self, record: dict) -> None:
        failed: list | None = None
        for metric in self.enabled:
            try:
                metric.read(record)
            except Exception as e:
                failed = failed or []
                failed.append(metric)
                self.unsupported[metric.name] = describe_error(e)
                self.log(f"{self.source}: {metric.name} failed ({describe_error(e)}); switched off")
        if failed:
            self.enabled = [m for m in self.enabled if m not in failed]

    def state(self) -> dict:
        return {"metrics": [m.name for m in self.enabled], "unsupported": dict(self.unsupported)}
