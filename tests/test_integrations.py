"""The Lightning and Hugging Face Trainer callbacks, with the real frameworks when installed."""

from __future__ import annotations

import pytest
import torch

import diag
from diag import rundir
from diag.integrations import _batch_size


def test_batch_size_of_nested_batches():
    assert _batch_size(torch.zeros(7, 3)) == 7
    assert _batch_size({"input_ids": torch.zeros(5, 9), "labels": torch.zeros(5)}) == 5
    assert _batch_size([torch.tensor(1.0), (torch.zeros(4, 2), 1)]) == 4
    assert _batch_size({"text": ["a"]}) is None


def _lightning_module(fail_at: int | None = None):
    import lightning.pytorch as pl

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(16, 1)

        def training_step(self, batch, batch_idx):
            if batch_idx == fail_at:
                raise RuntimeError("boom in training_step")
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Model()


def _lightning_fit(run_dir, fail_at=None, logger=False, **options):
    import lightning.pytorch as pl

    data = torch.utils.data.TensorDataset(torch.randn(96, 16), torch.randn(96, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    cb = diag.integrations.lightning_callback(run_dir=run_dir, export=False, skip_first=2, every=5, active=2,
                                              **options)
    trainer = pl.Trainer(max_epochs=1, callbacks=[cb], accelerator="cpu", devices=1, logger=logger,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(_lightning_module(fail_at), loader)
    return cb


def _tracked(summary: dict) -> tuple[dict, dict]:
    """What the trackers must hold: numbers and text taken from summary.json itself."""
    diagnosis = summary["diagnosis"]
    return ({"diag/step_time_ms": summary["step_stats"]["median_ms"],
             "diag/samples_per_s": summary["throughput"]["samples_per_s"],
             **{f"diag/share/{p}": v for p, v in diagnosis["phase_shares"].items() if v is not None}},
            {"diag/verdict": diagnosis["bound"], "diag/headline": diagnosis["headline"]["text"]})


def _assert_tracked(summary: dict, mlruns) -> None:
    """MLflow's file store and the W&B run hold summary.json's figures, as logged by the callback."""
    metrics, tags = _tracked(summary)
    logged_metrics, logged_tags = _mlflow_run(mlruns)
    assert {k: logged_metrics[k] for k in metrics} == pytest.approx(metrics)
    assert {k: logged_tags[k] for k in tags} == tags
    wandb_summary = _wandb_summary()
    assert {k: wandb_summary[k] for k in metrics} == pytest.approx(metrics)
    assert {k: wandb_summary[k] for k in tags} == tags


def _mlflow_run(tracking_dir) -> tuple[dict, dict]:
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"file:{tracking_dir}")
    (exp,) = [e for e in client.search_experiments() if e.name != "Default"] or client.search_experiments()
    (run,) = client.search_runs([exp.experiment_id])
    return run.data.metrics, run.data.tags


def _wandb_summary() -> dict:
    """The open W&B run's summary as the SDK holds it (offline, the run's file is wandb-core's
    binary log, which only wandb sync reads); then the run ends."""
    import wandb

    assert wandb.run is not None and wandb.run.offline
    summary = {k: wandb.run.summary.get(k) for k in wandb.run.summary.keys()}  # noqa: SIM118 - no __iter__
    wandb.finish()
    return summary


def test_lightning_callback(tmp_path, monkeypatch):
    """Also: with log_diagnosis, the diagnosis reaches the trainer's MLflow (a local file store) and
    W&B (offline) loggers, as summary.json holds it."""
    from lightning.pytorch.loggers import MLFlowLogger, WandbLogger

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store behind this switch
    monkeypatch.chdir(tmp_path)  # what the trackers write by default goes beside the run, never into the checkout
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    loggers = [MLFlowLogger(experiment_name="diag-test", tracking_uri=f"file:{tmp_path / 'mlruns'}"),
               WandbLogger(project="diag-test", save_dir=str(tmp_path), offline=True)]
    cb = _lightning_fit(tmp_path / "run", logger=loggers, report=True, report_wait_s=5, log_diagnosis=True)
    _assert_tracked(cb.agent.summary(), tmp_path / "mlruns")
    rd = rundir.RunDir(cb.agent.run_dir)
    steps = rd.steps(0)
    assert [s.step for s in steps] == list(range(12)) and all(s.samples == 8 for s in steps)
    assert rd.rank_info(0)["status"] == "completed"
    # The gap between steps, where Lightning fetches the next batch, is the data wait.
    assert steps[0].data_wait_s is None or steps[0].data_wait_s >= 0
    assert all(s.data_wait_s is not None and s.data_wait_s >= 0 for s in steps[1:])
    assert rd.windows(0), "no profiler window was recorded inside Lightning's loop"
    assert (cb.agent.run_dir / "report.html").is_file() and (cb.agent.run_dir / "summary.json").is_file()
    # What the live module and optimizer held, read from the trainer's own objects after step 0.
    facts = rd.rank_info(0)["model"]
    assert facts["params"] == 16 + 1 and facts["step"] == 0 and facts["class"] == "Model"  # Linear(16, 1)
    assert facts["param_bytes"] == facts["grad_bytes"] == 4 * 17
    assert facts["optimizer"] == "SGD" and facts["optimizer_state_bytes"] == 0  # plain SGD keeps no state
    # The trainer's DataLoader (batch_size=8 over a TensorDataset, no workers), for the data causes.
    loader = rd.rank_info(0)["loader"]
    assert (loader["dataset"], loader["batch_size"], loader["num_workers"]) == ("TensorDataset", 8, 0)


def test_lightning_exception_propagates_and_the_run_is_failed(tmp_path):
    with pytest.raises(RuntimeError, match="boom in training_step"):
        _lightning_fit(tmp_path / "run", fail_at=5, report=False)
    rd = rundir.RunDir(tmp_path / "run")
    assert len(rd.steps(0)) == 5
    info = rd.rank_info(0)
    assert info["status"] == "failed" and "boom in training_step" in str(info.get("error") or info)


class _Tokens(torch.utils.data.Dataset):
    """Random token ids for a causal language model (labels are the inputs, shifted by the model)."""

    def __len__(self):
        return 32

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, 64, (16,), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}


def _hf_trainer(tmp_path, monkeypatch, **options):
    import transformers

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a model built from a config: nothing is downloaded
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    report_to = options.pop("report_to", [])
    cb = diag.integrations.hf_callback(run_dir=tmp_path / "run", export=False, skip_first=1, every=3, active=1,
                                       **options)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4,
                                          num_train_epochs=1, report_to=report_to, use_cpu=True, save_strategy="no",
                                          logging_strategy="no", disable_tqdm=True)
    return transformers.Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=[cb]), cb


def test_hf_trainer_callback(tmp_path, monkeypatch):
    """Also: with log_diagnosis, the diagnosis reaches the MLflow run (a local file store) and the W&B
    run (offline) that the Trainer's own integrations opened, as summary.json holds it."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "diag-test")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # what the trackers write by default goes beside the run, never into the checkout
    import mlflow
    import wandb

    # As in a fresh process: W&B read its settings (the run folder among them) at an earlier test's run.
    wandb.teardown()

    # As in a fresh process: an earlier test's logger left MLflow's process-wide experiment behind.
    mlflow.set_tracking_uri(f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setattr(mlflow.tracking.fluent, "_active_experiment_id", None)
    monkeypatch.setenv("WANDB_PROJECT", "diag-test")
    trainer, cb = _hf_trainer(tmp_path, monkeypatch, report=True, report_wait_s=5, log_diagnosis=True,
                              report_to=["mlflow", "wandb"])
    trainer.train()
    _assert_tracked(cb.agent.summary(), tmp_path / "mlruns")
    rd = rundir.RunDir(cb.agent.run_dir)
    steps = rd.steps(0)
    assert [s.step for s in steps] == list(range(8)) and all(s.samples == 4 for s in steps)
    assert all(s.data_wait_s is not None and s.data_wait_s >= 0 for s in steps[1:])
    assert rd.rank_info(0)["status"] == "completed"
    assert rd.windows(0), "no profiler window was recorded inside the Trainer's loop"
    assert (cb.agent.run_dir / "report.html").is_file()
    # The model's facts, against transformers' own count (the tied output layer once) and
    # AdamW's two fp32 moments per trainable parameter.
    facts = rd.rank_info(0)["model"]
    n = trainer.model.num_parameters()
    assert facts["params"] == n and facts["param_bytes"] == 4 * n
    assert facts["optimizer"] in ("AcceleratedOptimizer", "AdamW") and facts["optimizer_state_bytes"] == 8 * n
    # The Trainer's own DataLoader over the job's dataset (accelerate's subclass of DataLoader).
    loader = rd.rank_info(0)["loader"]
    assert loader["dataset"] == "_Tokens" and loader["batch_size"] == 4 and loader["num_workers"] == 0
    from diag.analyzers.plan.models import from_hf_dict

    m = from_hf_dict(facts["config"], "recorded")
    assert (m.layers, m.hidden, m.heads, m.vocab, m.seq, m.gated_mlp, m.tied_embeddings) == (2, 32, 2, 64, 32,
                                                                                           False, True)
    # `diag plan --run` plans that transformer, on the FLOP/s its profiled steps achieved.
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "diag", "plan", "--run", str(cb.agent.run_dir), "--seq", "16",
                           "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["model"]["layers"] == 2 and plan["model"]["hidden"] == 32 and plan["layout"]["gpus"] == 1
    assert plan["rates"]["flops"].startswith("measured:") and plan["step_time_s"] > 0


def test_hf_trainer_exception_propagates(tmp_path, monkeypatch):
    trainer, cb = _hf_trainer(tmp_path, monkeypatch, report=False)

    def fail(*args, **kwargs):
        raise RuntimeError("boom in the model")

    trainer.model.forward = fail
    with pytest.raises(RuntimeError, match="boom in the model"):
        trainer.train()
    assert cb.agent is not None and cb.agent.run_dir.is_dir()
    cb.agent.close("failed", "RuntimeError: boom in the model")
    assert rundir.RunDir(cb.agent.run_dir).rank_info(0)["status"] == "failed"
