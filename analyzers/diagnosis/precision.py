"""Whether lower precision can pay on this job's hardware, and the advice withheld where not.

On a GPU bf16 and fp16 run on tensor cores many times faster than fp32. On a CPU they run
faster only on matrix units that take bf16 (AMX, AVX512-BF16); elsewhere torch converts to
fp32 and back, and a bf16 matmul runs slower than the fp32 one. Where the ranks compute on
such a CPU, the diagnosis withholds every piece of advice that rests on lower precision
(`[needs_half_precision]` in the tree): the verdicts' fixes that start so, and the what-if
changes, which stay in the table with the reason instead of a number.
"""

from __future__ import annotations

import dataclasses

import msgspec

from diag.analyzers.analysis_types import Job
from diag.analyzers.diagnosis.decision_tree import Tree
from diag.analyzers.diagnosis.inputs import Ranks, device_timeline
from diag.analyzers.numbers import dict_at


def cpu_without_bf16_units(ranks: Ranks) -> str | None:
    """The ISA of a CPU without bf16 matrix units that the job's ranks compute on ("" where
    its ISA is not recorded); None where any rank computes on a device, or no rank's CPU
    says it lacks them."""
    isa = None
    for merged in ranks.values():
        info = merged.info
        device = dict_at(info, "device")
        if device_timeline(merged.facts) or device.get("vendor"):
            return None
        cpu = info.get("cpu")
        if isinstance(cpu, dict) and cpu.get("bf16_units") is False:
            isa = str(cpu.get("isa") or "")
    return isa


def withhold_half_precision(job: Job, tree: Tree, isa: str | None) -> tuple[Job, Tree]:
    """(the job block, the tree) with the advice that needs lower precision withheld where the
    ranks' CPU lacks bf16 units (`isa` from cpu_without_bf16_units); as they were otherwise."""
    if isa is None:
        return job, tree
    needs = tree.needs_half_precision or {}
    starts = tuple(needs.get("fixes") or ())
    changes = set(needs.get("what_if") or ())
    verdicts = {name: {**v, "fixes": [f for f in v.get("fixes") or [] if not f.startswith(starts)]}
                for name, v in tree.verdicts.items()}
    cpu = f"this CPU ({isa})" if isa else "this CPU"
    note = (f"withheld: {cpu} has no bf16 matrix units (AMX, AVX512-BF16), so lower precision does not run "
            "faster here")
    what_if = [{**e, "predicted_step_ms": None, "speedup": None, "note": note}
               if isinstance(e, dict) and e.get("change") in changes else e for e in job.what_if]
    return msgspec.structs.replace(job, what_if=what_if), dataclasses.replace(tree, verdicts=verdicts)
