"""The diagnosis where users already track their runs: MLflow, Weights & Biases, TensorBoard.

`fields(summary)` flattens the job's summary (what `Agent.summary()` returns: summary.json,
written by rank 0 at close) into numeric metrics and short text tags under `diag/`; the
framework callbacks hand them to the trainer's loggers when asked (`log_diagnosis=True`):
- Lightning: every logger of the trainer gets the metrics (`log_metrics`); MLflow gets the
  text as run tags, W&B in the run's summary, TensorBoard as text, any other as hyperparameters;
- Hugging Face: the integrations named in `TrainingArguments.report_to`. Its MLflow callback
  has ended the run by then, so the tags and metrics go to that run by id; W&B's run is still
  open; TensorBoard gets a writer on the logging directory.
Nothing here may hurt the training or its end: each logger that fails is skipped, and the
failure is reported once through `log`. The values are the diagnosis's, never recomputed.
"""

from __future__ import annotations

import math
import time

from diag.analyzers.numbers import dict_at

PREFIX = "diag/"
MAX_TAG = 500  # MLflow caps tag values at 5000 characters; a headline needs far fewer


def fields(summary: dict | None) -> tuple[dict[str, float], dict[str, str]]:
    """(metrics, tags) of a summary: numbers under diag/..., text under diag/...; empty when absent."""
    if not isinstance(summary, dict):
        return {}, {}
    diag, stats, rate = dict_at(summary, "diagnosis"), dict_at(summary, "step_stats"), dict_at(summary, "throughput")
    metrics: dict[str, float] = {}

    def put(name, value):
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            metrics[PREFIX + name] = float(value)

    put("step_time_ms", stats.get("median_ms"))
    put("step_time_p90_ms", stats.get("p90_ms"))
    put("device_step_time_ms", stats.get("device_median_ms"))
    put("steps", stats.get("steps"))
    put("samples_per_s", rate.get("samples_per_s"))
    put("tokens_per_s", rate.get("tokens_per_s"))
    put("mfu", rate.get("mfu"))
    for phase, share in (diag.get("phase_shares") or {}).items():
        put(f"share/{phase}", share)
    confidence = dict_at(diag, "confidence")
    put("confidence", confidence.get("score"))
    put("stragglers", len(diag.get("stragglers") or []))
    episodes = (diag.get("straggler_episodes") or {}).get("episodes") or []
    put("straggler_lost_s", sum(e.get("cost_ms") or 0.0 for e in episodes if isinstance(e, dict)) / 1000.0)
    recs = [r for r in diag.get("recommendations") or [] if isinstance(r, dict) and not r.get("minor")]
    prediction = (recs[0].get("prediction") or {}) if recs else {}
    put("top_fix_speedup", prediction.get("speedup") if isinstance(prediction, dict) else None)
    headline = dict_at(diag, "headline")
    tags = {
        "verdict": diag.get("bound"),
        "headline": headline.get("text"),
        "confidence": confidence.get("level"),
        "top_fix": recs[0].get("title") if recs else None,
        "straggler_pattern": (diag.get("straggler_episodes") or {}).get("pattern"),
        "report": (summary.get("report") or {}).get("html") if isinstance(summary.get("report"), dict) else None,
    }
    return metrics, {PREFIX + k: str(v)[:MAX_TAG] for k, v in tags.items() if isinstance(v, str) and v}


def _each(targets, write, log) -> list[str]:
    """Call write(target) for each; the names of those written. A failure is logged, not raised."""
    done = []
    for name, target in targets:
        try:
            write(target)
            done.append(name)
        except Exception as exc:  # a tracker's failure must not end the training's shutdown
            log(f"trackers: {name}: not logged ({type(exc).__name__}: {exc})")
    return done


def log_lightning(trainer, summary: dict | None, log) -> list[str]:
    """The summary to every logger of a Lightning trainer; the names of those that took it."""
    metrics, tags = fields(summary)
    if not metrics and not tags:
        return []
    step = int(getattr(trainer, "global_step", 0) or 0)

    def write(logger):
        logger.log_metrics(metrics, step=step)
        kind = type(logger).__name__
        if kind == "MLFlowLogger":
            for k, v in tags.items():
                logger.experiment.set_tag(logger.run_id, k, v)
        elif kind == "WandbLogger":
            logger.experiment.summary.update(tags)
        elif kind == "TensorBoardLogger":
            for k, v in tags.items():
                logger.experiment.add_text(k, v, global_step=step)
        else:
            logger.log_hyperparams(tags)
        logger.save()

    loggers = list(getattr(trainer, "loggers", None) or [])
    return _each([(type(lg).__name__, lg) for lg in loggers], write, log)


def log_hf(args, summary: dict | None, log) -> list[str]:
    """The summary to the Hugging Face integrations that `args.report_to` names."""
    metrics, tags = fields(summary)
    report_to = getattr(args, "report_to", None) or []
    report_to = [report_to] if isinstance(report_to, str) else list(report_to)
    if (not metrics and not tags) or "none" in report_to:
        return []
    step = int(metrics.get(PREFIX + "steps", 0))
    writers = {"mlflow": lambda _: _mlflow(metrics, tags, step), "wandb": lambda _: _wandb(metrics, tags),
               "tensorboard": lambda _: _tensorboard(getattr(args, "logging_dir", None), metrics, tags, step)}
    done = []
    for name, write in writers.items():
        if name in report_to or "all" in report_to:
            done += _each([(name, None)], write, log)
    return done


def _mlflow(metrics: dict, tags: dict, step: int) -> None:
    import mlflow
    from mlflow.entities import Metric, RunTag

    run = mlflow.active_run() or mlflow.last_active_run()
    if run is None:
        raise RuntimeError("no MLflow run: the MLflow integration did not start one")
    now = int(time.time() * 1000)
    mlflow.MlflowClient().log_batch(run.info.run_id,
                                    metrics=[Metric(k, v, now, step) for k, v in metrics.items()],
                                    tags=[RunTag(k, v) for k, v in tags.items()])


def _wandb(metrics: dict, tags: dict) -> None:
    import wandb

    if wandb.run is None:
        raise RuntimeError("no W&B run: the W&B integration did not start one")
    wandb.run.summary.update({**metrics, **tags})


def _tensorboard(logdir, metrics: dict, tags: dict, step: int) -> None:
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(log_dir=logdir) as writer:
        for k, v in metrics.items():
            writer.add_scalar(k, v, step)
        for k, v in tags.items():
            writer.add_text(k, v, step)
