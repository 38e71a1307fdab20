"""The prefixes launchers, log collectors and pastes put before each line of nccl-tests output:
the known ones (OpenMPI tags and timestamps, srun labels, Ray worker tags, Markdown quotes),
and one found from the lines themselves.
"""

from __future__ import annotations

import re

_PREFIX = re.compile(
    r"""^(?:
        \s*\w{3}\ \w{3}\ +\d{1,2}\ \d{2}:\d{2}:\d{2}\ \d{4}(?=[<\[])  # OpenMPI --timestamp-output
      | \s*(?:\[\d+,\d+\])?<(?:stdout|stderr)>:\s?      # OpenMPI --tag-output / --timestamp-output
      | \s*\d+:\s                                      # srun --label
      | \s*\[\d+\]\s?                                  # [task] labels
      | \[?\d{4}-\d{2}-\d{2}[T\ ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?\]?\s  # timestamps
      | \s*>\s?                                        # Markdown quote
      | \([^()]*\bpid=\d+[^()]*\)\s                    # Ray worker tag
    )+""",
    re.X,
)


def strip_prefix(line: str) -> str:
    """Remove launcher, label and timestamp prefixes (they are part of real pasted output)."""
    m = _PREFIX.match(line)
    return line[m.end():] if m else line


# A prefix not in _PREFIX (a log collector's, a custom launcher's) is found from the lines
# themselves: digits masked, it is the same on nearly every line and ends in a delimiter.
_SHARED_MIN = 0.9
_PREFIX_END = ":>]|"
_DIGIT = re.compile(r"\d")


def shared_prefix(lines: list[str]) -> re.Pattern | None:
    """A pattern for the prefix that (digits aside) nearly every non-empty line begins with."""
    shapes = [_DIGIT.sub("0", ln[:96]) for ln in lines if ln.strip()]
    if len(shapes) < 5:
        return None
    first = sorted(shapes)[len(shapes) // 2]  # a typical line
    best = None
    for end in range(len(first)):
        if first[end] not in _PREFIX_END:
            continue
        head = first[: end + 1]
        if sum(1 for x in shapes if x.startswith(head)) < _SHARED_MIN * len(shapes):
            break
        best = head
    if best is None or best.lstrip().startswith("#") or sum(not c.isspace() for c in best) < 3:
        return None
    return re.compile("^" + re.escape(best).replace("0", r"\d") + r"\s?")
