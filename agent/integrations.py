"""Thin callbacks that run `diag.Agent` inside PyTorch Lightning and the Hugging Face Trainer.

    trainer = lightning.pytorch.Trainer(callbacks=[diag.integrations.lightning_callback(run_dir="runs/x")])
    trainer = transformers.Trainer(..., callbacks=[diag.integrations.hf_callback(run_dir="runs/x")])

With `log_diagnosis=True` the diagnosis goes, at the end of training, to the trainer's own
loggers (MLflow, W&B, TensorBoard, ...) as `diag/...` metrics and tags (`diag.trackers`).

Both frameworks own the loop, so the agent cannot wrap the DataLoader. The data wait of
a step is the time from the end of the previous step to the start of this one, which
is where both frameworks fetch the next batch (plus their own small bookkeeping).
The frameworks are imported only when a callback is created; neither is a dependency.
"""

from __future__ import annotations

import time

from diag import trackers


def _batch_size(batch) -> int | None:
    """Samples in a batch: the leading dimension of its first tensor."""
    seen = [batch]
    while seen:
        b = seen.pop(0)
        shape = getattr(b, "shape", None)
        if shape is not None and len(shape) > 0:
            return int(shape[0])
        if isinstance(b, dict):
            seen.extend(b.values())
        elif isinstance(b, (list, tuple)):
            seen.extend(b)
    return None


class _StepClock:
    """Data wait from the gap between steps (the frameworks fetch the batch there)."""

    def __init__(self, agent):
        self.agent = agent
        self.last_end: float | None = None

    def step_begins(self) -> None:
        if self.last_end is not None and self.agent.timer is not None:
            self.agent.timer.add_data_wait(time.perf_counter() - self.last_end)

    def step_ends(self, samples=None, tokens=None) -> None:
        self.agent.step(samples=samples, tokens=tokens)
        self.last_end = time.perf_counter()


def lightning_callback(log_diagnosis: bool = False, **agent_options):
    """A `lightning.pytorch.Callback` (or `pytorch_lightning.Callback`) running the agent during fit;
    with `log_diagnosis`, rank 0 logs the diagnosis to the trainer's loggers at the end of fit."""
    try:
        from lightning.pytorch import Callback
    except ImportError:
        from pytorch_lightning import Callback  # the older package name

    from diag.agent import Agent

    class DiagLightningCallback(Callback):
        def __init__(self):
            super().__init__()
            self.agent: Agent | None = None
            self._clock: _StepClock | None = None

        def on_fit_start(self, trainer, pl_module):
            self.agent = Agent(**agent_options).start()
            self._clock = _StepClock(self.agent)

        def on_train_start(self, trainer, pl_module):
            if self.agent is not None:  # the optimizers and the train DataLoader exist by now
                self.agent.watch(pl_module, trainer.optimizers[0] if trainer.optimizers else None)
                self.agent.record_loader(getattr(trainer, "train_dataloader", None))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if self._clock is not None:
                self._clock.step_begins()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self._clock is not None:
                self._clock.step_ends(samples=_batch_size(batch))

        def on_exception(self, trainer, pl_module, exception):
            if self.agent is not None:
                status = "interrupted" if isinstance(exception, KeyboardInterrupt) else "failed"
                self.agent.close(status, f"{type(exception).__name__}: {exception}")

        def on_fit_end(self, trainer, pl_module):
            if self.agent is not None:
                self.agent.close("completed")
                if log_diagnosis and self.agent.rank == 0:
                    trackers.log_lightning(trainer, self.agent.summary(), self.agent._log)

    return DiagLightningCallback()


def hf_callback(log_diagnosis: bool = False, **agent_options):
    """A `transformers.TrainerCallback` running the agent during `Trainer.train()`; with
    `log_diagnosis`, rank 0 logs the diagnosis to the integrations `report_to` names at the end.

    The Trainer has no exception hook: a crashed run is closed by the agent's exit
    handler with status "interrupted", and is still reportable.
    """
    from transformers import TrainerCallback

    from diag.agent import Agent

    class DiagTrainerCallback(TrainerCallback):
        def __init__(self):
            self.agent: Agent | None = None
            self._clock: _StepClock | None = None
            self._samples: int | None = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.agent = Agent(**agent_options).start()
            self._clock = _StepClock(self.agent)
            per_device = getattr(args, "per_device_train_batch_size", None)
            accum = getattr(args, "gradient_accumulation_steps", 1) or 1
            # Samples per optimizer step on this rank.
            self._samples = per_device * accum if per_device else None
            if kwargs.get("model") is not None:
                self.agent.watch(kwargs["model"], kwargs.get("optimizer"))
            self.agent.record_loader(kwargs.get("train_dataloader"))

        def on_step_begin(self, args, state, control, **kwargs):
            if self._clock is not None:
                self._clock.step_begins()

        def on_step_end(self, args, state, control, **kwargs):
            if self._clock is not None:
                self._clock.step_ends(samples=self._samples)

        def on_train_end(self, args, state, control, **kwargs):
            if self.agent is not None:
                self.agent.close("completed")
                if log_diagnosis and self.agent.rank == 0:
                    trackers.log_hf(args, self.agent.summary(), self.agent._log)

    return DiagTrainerCallback()
