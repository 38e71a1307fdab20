"""The Lightning and Hugging Face Trainer callbacks, with the real frameworks when installed."""

from __future__ import annotations

import pytest
import torch

from diag import rundir
from diag.integrations import _batch_size


def test_batch_size_of_nested_batches():
    assert _batch_size(torch.zeros(7, 3)) == 7
    assert _batch_size({"input_ids": torch.zeros(5, 9), "labels": torch.zeros(5)}) == 5
    assert _batch_size([torch.tensor(1.0), (torch.zeros(4, 2), 1)]) == 4
    assert _batch_size({"text": ["a"]}) is None


def test_lightning_callback(tmp_path):
    pl = pytest.importorskip("lightning.pytorch", reason="PyTorch Lightning is not installed")
    from diag.integrations import lightning_callback

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(16, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = torch.utils.data.TensorDataset(torch.randn(96, 16), torch.randn(96, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    cb = lightning_callback(run_dir=tmp_path / "run", export=False, skip_first=2, every=5, active=2, report=False)
    trainer = pl.Trainer(max_epochs=1, callbacks=[cb], accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(Model(), loader)
    rd = rundir.RunDir(cb.agent.run_dir)
    steps = rd.steps(0)
    assert len(steps) == 12 and all(s["samples"] == 8 for s in steps)
    assert rd.rank_info(0)["status"] == "completed"
    assert all(s["data_wait_s"] is not None for s in steps[1:])


def test_hf_trainer_callback(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    pytest.importorskip("accelerate", reason="the Trainer needs accelerate (transformers[torch])")
    from diag.integrations import hf_callback

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(16, 1)

        def forward(self, x, labels=None):
            out = self.net(x)
            return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            return {"x": torch.randn(16, generator=g), "labels": torch.randn(1, generator=g)}

    cb = hf_callback(run_dir=tmp_path / "run", export=False, skip_first=2, every=5, active=2, report=False)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8,
                                          num_train_epochs=1, report_to=[], use_cpu=True, save_strategy="no",
                                          logging_strategy="no")
    trainer = transformers.Trainer(model=Tiny(), args=args, train_dataset=Data(), callbacks=[cb])
    trainer.train()
    rd = rundir.RunDir(cb.agent.run_dir)
    steps = rd.steps(0)
    assert len(steps) == 8 and all(s["samples"] == 8 for s in steps)
    assert rd.rank_info(0)["status"] == "completed"
