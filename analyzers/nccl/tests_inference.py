"""What a saved nccl-tests excerpt without its header still tells: the collective and the world
size, from the element counts and the busbw/algbw factor of its table.
"""

from __future__ import annotations

import math

from diag.analyzers.dtypes import element_bytes

REDUCTIONS = {"sum", "prod", "max", "min", "avg", "mulsum", "premulsum"}

# Binary stem -> collective name used in diag.nccl_bench/1 (the runner uses the same names).
COLLECTIVES = {
    "all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
    "broadcast": "broadcast", "reduce": "reduce", "alltoall": "alltoall", "sendrecv": "sendrecv",
    "scatter": "scatter", "gather": "gather", "hypercube": "hypercube", "alltoallv": "alltoallv",
}


def collective_from_binary(stem: str) -> str | None:
    return COLLECTIVES.get(stem)


def world_from_allreduce_factor(algbw: float, busbw: float) -> int | None:
    """n from busbw = algbw * 2(n-1)/n, using the 2-decimal rounding of the printed values."""
    lo = (busbw - 0.005) / (algbw + 0.005)
    hi = (busbw + 0.005) / (algbw - 0.005) if algbw > 0.005 else math.inf
    if hi < 1.0 - 1e-9 or lo >= 2.0:
        return None
    n_lo = 2.0 / (2.0 - max(lo, 0.0))
    n_hi = math.inf if hi >= 2.0 else 2.0 / (2.0 - hi)
    cands = [n for n in range(max(1, math.ceil(n_lo - 1e-9)), int(min(n_hi, 1e6)) + 1) if n >= 2] if n_hi < 1e6 else []
    return cands[0] if len(cands) == 1 else None


def infer(rows: list[dict], out: dict) -> None:
    """Collective and world size from a test's rows when the header did not give them."""
    rows = [r for r in rows if r["size_bytes"] > 0 and (r["count"] or 0) > 0 and r["out_of_place"]]
    if not rows:
        return
    big = max(rows, key=lambda r: (r["out_of_place"]["algbw_gbps"] or 0, r["size_bytes"]))
    esize = element_bytes(str(big["dtype"]))
    inferred = []
    redop, root = big["redop"], big["root"]
    ratio = big["size_bytes"] / (big["count"] * esize) if esize else None
    coll = world = None
    if ratio is not None and ratio >= 1.5:  # the count is per rank
        world = round(ratio) if abs(ratio - round(ratio)) < 0.05 else None
        if redop in REDUCTIONS:
            coll = "reduce_scatter"
    else:
        a, b = big["out_of_place"]["algbw_gbps"], big["out_of_place"]["busbw_gbps"]
        factor = b / a if a and b is not None and a >= 0.1 else None
        if redop in REDUCTIONS and (root == -1 or (root is None and factor is not None and factor > 1.05)):
            # only all_reduce has a bus factor above 1; old tables have no root column
            coll = "all_reduce"
            if a and b is not None and a >= 0.1:
                world = world_from_allreduce_factor(a, b)
        elif redop in REDUCTIONS and root is not None and root >= 0:
            coll = "reduce"
        elif redop in (None, "none") and root is not None and root >= 0:
            coll = "broadcast"
        elif redop == "none" and root == -1 and a and b is not None and a >= 0.1 and abs(b - a) <= 0.011:
            coll = "sendrecv"
    if out["collective"] is None and coll:
        out["collective"] = coll
        inferred.append("collective")
    if out["world_size"] is None and world:
        out["world_size"] = world
        inferred.append("world_size")
    if inferred:
        out["inferred"] = inferred
