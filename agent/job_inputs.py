"""What the job hands the agent. The samples and tokens it passes to `agent.step()` are checked
on the training thread at the cost of a comparison: counts no step can hold are left out, and
`samples=len(batch)` on an (inputs, labels) batch is named, each said once. The model and
optimizer it passes to `agent.watch()` are described once, in rank.json."""

from __future__ import annotations

import numbers
from collections.abc import Callable

from diag import step_record
from diag.batches import count_samples
from diag.batches import parts as batch_parts


def plausible(value, field: str) -> bool:
    """A step's count as the job passed it: a plain number is checked here (step_record.plausible_count);
    a tensor or NumPy scalar is read only when the record is written, off the training thread
    (reading a device tensor waits for the device), and checked when the run is read."""
    return step_record.plausible_count(value, field) or (not isinstance(value, numbers.Real) and hasattr(value, "item"))


class StepCounts:
    def __init__(self):
        self.batch_shape: tuple | None = None  # (samples, parts) of the first batch loader() gave
        self.said: set[str] = set()  # counts (samples, tokens) already said to be implausible

    def note_batch(self, batch) -> None:
        if self.batch_shape is None:
            self.batch_shape = (count_samples(batch), batch_parts(batch))

    def checked(self, samples, tokens, log: Callable[[str], None]) -> tuple:
        if not (plausible(samples, "samples") and plausible(tokens, "tokens")):
            samples, tokens = self._plausible(samples, tokens, log)
        if samples is not None and self.batch_shape is not None and not self.said:
            self._check_samples(samples, log)
        return samples, tokens

    def _check_samples(self, samples, log) -> None:
        """A step's samples equal to the parts of the batches loader() gives, not to their samples."""
        if self.batch_shape is None:
            return
        held, n_parts = self.batch_shape
        if held is not None and n_parts is not None and held != n_parts and samples == n_parts:
            self.said.add("samples")
            log(f"agent.step(samples={samples}): the batches from loader() hold {held} samples each (the "
                f"first dimension of their first tensor), and {n_parts} parts: len(batch) counts the parts. "
                "Pass samples=diag.count_samples(batch).")

    def _plausible(self, samples, tokens, log) -> tuple:
        """The step's counts with those no step can hold (1e30, a tensor, NaN) left out, said once."""
        out = []
        for field, value in (("samples", samples), ("tokens", tokens)):
            if plausible(value, field):
                out.append(value)
                continue
            out.append(None)
            if field not in self.said:
                self.said.add(field)
                log(f"agent.step({field}={str(value)[:40]}): not a count of {field} one step can hold "
                    f"(a number from 0 to {step_record.MAX_STEP_COUNTS[field]:.0e}); left out of this and later "
                    "steps' throughput")
        return tuple(out)


def record_model(writer, model, optimizer, step: int, log: Callable[[str], None]) -> None:
    """What `model` and `optimizer` hold (diag.collectors.model_facts), in rank.json."""
    try:
        from diag.collectors.model_facts import describe

        facts = dict(describe(model, optimizer), step=step)
    except Exception as exc:
        log(f"model facts: off ({type(exc).__name__}: {exc})")
        return
    if writer is not None:
        writer.update_info(model=facts)
