"""How many samples a batch holds, from the batch itself.

A batch is a tensor, or a tuple, list or dict of them (`(inputs, labels)`, a Hugging Face
`BatchEncoding`), possibly nested: its samples are the first dimension of the first tensor
in it. `len(batch)` counts the parts of an `(inputs, labels)` tuple (2) or the keys of a dict,
not its samples. Reading a shape costs nothing (no copy, no wait for the device).
"""

from __future__ import annotations

from collections.abc import Mapping

MAX_DEPTH = 4  # nesting walked into before giving up


def count_samples(batch, _depth: int = 0) -> int | None:
    """The samples in `batch`: the first dimension of the first tensor (anything with a
    non-empty `.shape`) found in it, depth first; for a list of plain items (strings, ints),
    its length; None where neither is found."""
    shape = getattr(batch, "shape", None)
    if shape is not None:
        try:
            return int(shape[0]) if len(shape) else None
        except (TypeError, ValueError, IndexError):
            return None
    if _depth >= MAX_DEPTH:
        return None
    if isinstance(batch, Mapping):
        parts = list(batch.values())
    elif isinstance(batch, (tuple, list)):
        parts = list(batch)
    else:
        return None
    for part in parts:
        n = count_samples(part, _depth + 1)
        if n is not None:
            return n
    plain = isinstance(batch, list) and parts and all(isinstance(p, (str, bytes, int, float)) for p in parts)
    return len(parts) if plain else None


def parts(batch) -> int | None:
    """What len() of a container batch gives (its parts), None for anything else."""
    return len(batch) if isinstance(batch, (tuple, list, Mapping)) else None
