"""What `diag top` draws: the job's line, a table of ranks, an opened rank, the keys.

Rendered with rich. Every string from the job (host names, reasons, errors, paths) goes in
as a `rich.text.Text` of its `visible` form: Text reads no markup, and rich strips only some
control codes (not the escape that starts a terminal sequence), so each character a terminal
would act on is written as its escape first. A name can neither style nor move anything. The view renders the live judgement (`diagnosis.live.judge_live`); it
decides nothing itself.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass, field

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from diag.errors import visible

# (key, header, attribute of RankLive or a function of it) in the order of the `s` key.
COLUMNS = (
    ("rank", "rank", lambda r: r.rank),
    ("step", "step ms", lambda r: r.step_ms),
    ("device", "device ms", lambda r: r.device_ms),
    ("data", "data ms", lambda r: r.data_wait_ms),
    ("wait", "peers ms", lambda r: r.wait_ms),
    ("gpu", "GPU %", lambda r: r.gpu_util),
    ("memory", "memory", lambda r: r.gpu_mem_used),
    ("power", "W", lambda r: r.power_w),
)
SORT_KEYS = tuple(c[0] for c in COLUMNS)


@dataclass
class ViewState:
    """What the keys change: the sort, the selected row, the opened rank, the last message."""
    sort: str = "rank"
    reverse: bool = False
    selected: int = 0
    opened: int | None = None
    message: str = ""
    started: float = field(default_factory=time.time)


def sorted_ranks(ranks: list, state: ViewState) -> list:
    get = dict((k, f) for k, _, f in COLUMNS)[state.sort]
    present = [r for r in ranks if get(r) is not None]
    missing = [r for r in ranks if get(r) is None]
    # Ranks not read yet carry -1, -2, ... in the order of their endpoints.
    return sorted(present, key=get, reverse=state.reverse) + sorted(missing, key=lambda r: (r.rank < 0, abs(r.rank)))


def _safe(s, none: str = "-") -> Text:
    """Untrusted text as a terminal shows it: every control character as its escape."""
    return Text(visible(s) if isinstance(s, str) and s else none)


def _f(v, fmt: str = "{:.1f}", none: str = "-") -> str:
    return none if v is None else fmt.format(v)


def _bytes(v) -> str:
    if v is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if v >= size:
            return f"{v / size:.1f} {unit}"
    return f"{v / 1024:.0f} KiB"


def _rank_label(r) -> str:
    return str(r.rank) if r.rank >= 0 else "?"


def job_line(job: dict, ranks: list) -> Text:
    live = sum(1 for r in ranks if r.status == "running")
    t = Text()
    if job.get("final"):
        t.append("finished: ", style="bold")
        t.append_text(_safe(job["final"]))
        t.append("\n")
    t.append(f"ranks {live}/{len(ranks)} running", style="bold")
    t.append("   verdict ")
    t.append_text(_safe(job.get("verdict")))
    t.append(f"   throughput {_f(job.get('samples_per_s'), '{:.1f}')} samples/s")
    if job.get("tokens_per_s"):
        t.append(f", {job['tokens_per_s']:.0f} tokens/s")
    t.append(f"   MFU {_f(job.get('mfu'), '{:.1%}')}")
    t.append("   profiling ")
    t.append("yes" if job.get("profiling") else "no", style="bold magenta" if job.get("profiling") else "")
    return t


def pace_line(job: dict) -> Text:
    t = Text()
    t.append("pace set by rank ")
    t.append(str(job["pace_rank"]) if job.get("pace_rank") is not None else "-", style="bold")
    s = job.get("straggler")
    t.append("   straggler ")
    if s:
        t.append(f"rank {s['rank']} (+{s['excess_ms']:.1f} ms/step): ", style="bold red")
        t.append_text(_safe(s.get("text"), ""))
    else:
        t.append("none")
    ep = job.get("episode")
    if ep:
        who = f"rank {ep['rank']}" if ep.get("rank") is not None else "ranks " + ", ".join(map(str, ep["ranks"][:6]))
        t.append("   episode: ", style="bold red")
        t.append(f"{ep['kind']}, {who}, since step {ep['first_step']}")
    if job.get("stalled"):
        t.append("   stalled: ", style="bold red")
        t.append(", ".join(f"rank {r}" for r in job["stalled"][:16]))
    return t


def ranks_table(ranks: list, job: dict, state: ViewState) -> Table:
    table = Table(expand=True, pad_edge=False, show_edge=False)
    for key, header, _ in COLUMNS[:1]:
        table.add_column(header + (" v" if state.sort == key and state.reverse else " ^" if state.sort == key else ""),
                         justify="right", no_wrap=True)
    table.add_column("host", no_wrap=True, max_width=28)
    table.add_column("status", no_wrap=True)
    table.add_column("steps", justify="right", no_wrap=True)
    for key, header, _ in COLUMNS[1:]:
        mark = (" v" if state.reverse else " ^") if state.sort == key else ""
        table.add_column(header + mark, justify="right", no_wrap=True)
    table.add_column("verdict", no_wrap=True)
    table.add_column("throttle / XID / problem", no_wrap=True, max_width=40)
    strag = (job.get("straggler") or {}).get("rank")
    stalled = set(job.get("stalled") or ())
    for i, r in enumerate(sorted_ranks(ranks, state)):
        flags = ", ".join(r.clock_events) if r.clock_events else ""
        if r.xid_errors:
            flags = (flags + "; " if flags else "") + f"XID {r.xid_errors}"
        if r.status == "unreachable":
            flags = r.error or ""
        status = "stalled" if r.rank in stalled else r.status
        if r.profiling:
            status += " (profiling)"
        style = "reverse" if i == state.selected else ("red" if r.rank == strag or r.rank in stalled else "")
        table.add_row(
            _rank_label(r), _safe(r.host or r.endpoint), _safe(status), _f(r.steps_done, "{:d}"),
            _f(r.step_ms), _f(r.device_ms), _f(r.data_wait_ms), _f(r.wait_ms),
            _f(r.gpu_util, "{:.0%}"), _bytes(r.gpu_mem_used), _f(r.power_w, "{:.0f}"),
            _safe(r.bound), _safe(flags), style=style,
        )
    return table


def rank_detail(r, job: dict, now: float) -> Panel:
    t = Text()
    t.append(f"rank {_rank_label(r)} on ")
    t.append_text(_safe(r.host))
    t.append("   status ")
    t.append_text(_safe(r.status))
    t.append(f"   steps {_f(r.steps_done, '{:d}')}")
    if r.last_step_unix is not None:
        t.append(f"   last step ended {max(now - r.last_step_unix, 0.0):.1f} s ago")
    body = [t, Text.assemble(f"from the {r.source.replace('_', ' ')} ", _safe(r.endpoint))]
    pace = (job.get("pace_ms") or {}).get(r.rank)
    body.append(Text(f"pace (step less waiting for peers) {_f(pace)} ms   samples/s {_f(r.samples_per_s)}   "
                     f"tokens/s {_f(r.tokens_per_s, '{:.0f}')}   MFU {_f(r.mfu, '{:.1%}')}"))
    body.append(Text(f"GPU {_f(r.gpu_util, '{:.0%}')}   memory {_bytes(r.gpu_mem_used)} of {_bytes(r.gpu_mem_total)}"
                     f"   power {_f(r.power_w, '{:.0f}')} W   XID errors {_f(r.xid_errors, '{:d}')}"))
    body.append(Text.assemble("clock events: ", _safe(", ".join(r.clock_events), "none")))
    if r.window:
        body.append(Text(f"profiler window recording steps {r.window[0]}-{r.window[1]}"))
    if r.recent_step_ms:
        recent = ", ".join(f"{x:.1f}" for x in r.recent_step_ms[-12:])
        body.append(Text(f"last step times (ms): {recent}"))
    if r.error:
        body.append(Text.assemble("problem: ", _safe(r.error)))
    return Panel(Group(*body), title=f"rank {_rank_label(r)}", title_align="left")


KEYS_HELP = "up/down select  enter open rank  s sort  r reverse  p profile every rank  q quit"


def screen(source_desc: str, ranks: list, job: dict, state: ViewState, now: float, interval_s: float,
           keys: bool = True) -> Group:
    """The whole screen; `keys`: the interactive keys' legend at its foot (none for a screen
    drawn once, which takes no keys)."""
    head = Text()
    head.append("diag top", style="bold")
    head.append("  ")
    head.append_text(_safe(source_desc))
    head.append(f"  {time.strftime('%H:%M:%S', time.localtime(now))}  every {interval_s:g} s")
    parts = [head, job_line(job, ranks), pace_line(job), ranks_table(ranks, job, state)]
    if state.opened is not None:
        r = next((x for x in ranks if x.rank == state.opened), None)
        if r is not None:
            parts.append(rank_detail(r, job, now))
    foot = Text(KEYS_HELP if keys else "", style="dim")
    if state.message:
        if keys:
            foot.append("   ")
        foot.append_text(_safe(state.message))
    if foot.plain:
        parts.append(foot)
    return Group(*parts)


def one_line(ranks: list, job: dict, now: float) -> str:
    """The refresh as one line, for a stdout that is not a terminal (a log, a pipe)."""
    live = [r for r in ranks if r.status == "running"]
    steps = [r.steps_done for r in ranks if r.steps_done is not None]
    step_ms = sorted(r.step_ms for r in live if r.step_ms is not None)
    s = job.get("straggler")
    parts = [
        time.strftime("%H:%M:%S", time.localtime(now)),
        f"ranks {len(live)}/{len(ranks)}",
        f"steps {max(steps) if steps else '-'}",
        f"step {_f(step_ms[len(step_ms) // 2] if step_ms else None)} ms",
        f"verdict {job.get('verdict') or '-'}",
        f"{_f(job.get('samples_per_s'))} samples/s",
        f"MFU {_f(job.get('mfu'), '{:.1%}')}",
        f"pace rank {job['pace_rank'] if job.get('pace_rank') is not None else '-'}",
        f"straggler {'rank ' + str(s['rank']) + ' (' + s['cause'] + ')' if s else 'none'}",
        f"episode {job['episode']['kind'] if job.get('episode') else 'none'}",
        f"stalled {','.join(map(str, job['stalled'])) if job.get('stalled') else 'none'}",
        f"profiling {'yes' if job.get('profiling') else 'no'}",
    ]
    if job.get("final"):
        parts.append(f"finished: {job['final']}")
    return "  ".join(parts)


def render_text(renderable, width: int = 160) -> str:
    """The screen as plain text, as a terminal of `width` columns would show it."""
    console = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False, record=True)
    console.print(renderable)
    return console.export_text()
