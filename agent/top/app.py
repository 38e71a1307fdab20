"""The `diag top` loop: read the source, judge, draw; between refreshes, answer the keys.

On a terminal the screen is redrawn in place (rich's Live, on the alternate screen) every
`interval_s`, and a key redraws at once. Elsewhere (a pipe, a log file) each refresh is one
line. It ends on `q`, Ctrl-C, after `iterations` refreshes, or when every rank has ended.
"""

from __future__ import annotations

import time

from diag import rundir
from diag.analyzers.diagnosis.live import judge_live
from diag.top.keys import KeyReader
from diag.top.screen import SORT_KEYS, ViewState, one_line, screen, sorted_ranks

ENDED = rundir.FINAL_STATUSES


def apply_key(key: str, state: ViewState, ranks: list, source) -> bool:
    """Change the view for one key; False when the key ends `diag top`."""
    if key in ("q", "Q"):
        return False
    rows = sorted_ranks(ranks, state)
    if key == "up":
        state.selected = max(0, state.selected - 1)
    elif key == "down":
        state.selected = min(max(len(rows) - 1, 0), state.selected + 1)
    elif key == "enter" and rows:
        rank = rows[min(state.selected, len(rows) - 1)].rank
        state.opened = None if state.opened == rank else rank
    elif key == "escape":
        state.opened = None
    elif key == "s":
        state.sort = SORT_KEYS[(SORT_KEYS.index(state.sort) + 1) % len(SORT_KEYS)]
        state.message = f"sorted by {state.sort}"
    elif key == "r":
        state.reverse = not state.reverse
    elif key == "p":
        try:
            state.message = source.request_profile()
        except OSError as exc:
            state.message = f"profiler request failed: {exc.strerror or exc}"
    return True


def snapshot(source, tree, now: float | None = None) -> tuple[list, dict, float]:
    """The ranks as read now and the live judgement; once every rank has ended, with the run's
    own final diagnosis where the source has one (a run directory's summary.json)."""
    now = time.time() if now is None else now
    ranks = source.read(now)
    job = judge_live(ranks, tree, now)
    if all_ended(ranks):
        final = source.final()
        if final:
            job = {**job, "final": final}
    return ranks, job, now


def all_ended(ranks: list) -> bool:
    return bool(ranks) and all(r.status in ENDED for r in ranks)


def run_lines(source, tree, out, interval_s: float, iterations: int | None) -> int:
    """One line per refresh (stdout is not a terminal)."""
    n = 0
    while True:
        started = time.monotonic()
        ranks, job, now = snapshot(source, tree)
        out.write(one_line(ranks, job, now) + "\n")
        out.flush()
        n += 1
        if (iterations is not None and n >= iterations) or all_ended(ranks):
            return 0
        time.sleep(max(0.0, interval_s - (time.monotonic() - started)))


def run_screen(source, tree, console, interval_s: float, iterations: int | None, keys_stream=None) -> int:
    """The full-screen view with keys."""
    from rich.live import Live

    state = ViewState()
    n = 0
    with KeyReader(keys_stream) as keys, Live(console=console, screen=True, auto_refresh=False,
                                              transient=False) as live:
        ranks, job, now = snapshot(source, tree)
        next_read = time.monotonic() + interval_s
        while True:
            live.update(screen(source.describe(), ranks, job, state, now, interval_s), refresh=True)
            n += 1
            if iterations is not None and n >= iterations:
                return 0
            if all_ended(ranks):
                break  # the job is over: its last frame stays on the terminal below
            wait = next_read - time.monotonic()
            pressed = keys.read(wait) if keys.active else []
            if not keys.active:
                time.sleep(max(wait, 0.0))
            for key in pressed:
                if not apply_key(key, state, ranks, source):
                    return 0
            if time.monotonic() >= next_read:
                ranks, job, now = snapshot(source, tree)
                next_read = time.monotonic() + interval_s
    console.print(screen(source.describe(), ranks, job, state, now, interval_s))
    return 0
