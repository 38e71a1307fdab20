"""A DataLoader with workers that still keeps the step waiting: busy workers (decoding on the
CPU) told from idle ones (waiting on reads), on real single-rank runs under the agent, with
the workers' CPU read by the agent's psutil sampler."""

from __future__ import annotations

import os
import time

import pytest
import torch

import diag
from diag.analyzers.analyze import analyze_run_dir

WORKERS = 2
STEPS = 48


class Decoding(torch.utils.data.Dataset):
    """Each sample costs 25 ms of CPU, as JPEG decoding and augmentation would."""

    def __len__(self):
        return 1 << 20

    def __getitem__(self, i):
        end = time.process_time() + 0.025
        while time.process_time() < end:
            pass
        return torch.ones(8)


class Remote(torch.utils.data.Dataset):
    """Each sample waits 25 ms for a read and costs no CPU, as remote storage would."""

    def __len__(self):
        return 1 << 20

    def __getitem__(self, i):
        time.sleep(0.025)
        return torch.ones(8)


def _run(tmp_path, dataset) -> dict:
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=WORKERS, prefetch_factor=2)
    model = torch.nn.Linear(8, 1)
    with diag.Agent(run_dir=tmp_path / "run", export=False, profile=False, report=False, nccl_log=False,
                    verbose=False, sample_interval_s=0.25) as agent:
        for _, x in zip(range(STEPS), agent.loader(loader)):
            model(x).sum().backward()
            agent.step(samples=4)
    doc = analyze_run_dir(tmp_path / "run")
    assert doc["diagnosis"]["bound"] == "data", doc["diagnosis"]["headline"]
    return doc


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs for 2 workers")]


def test_workers_that_decode_on_the_cpu_are_busy(tmp_path):
    doc = _run(tmp_path, Decoding())
    (cause,) = [c for c in doc["diagnosis"]["causes"] if c["id"] == "data_loader_workers"]
    ev = cause["evidence"]
    # Two workers spinning on the CPU for every sample: about two CPUs, read by psutil.
    assert ev["kind"] == "busy" and ev["workers_cpu"] >= 0.8 * WORKERS
    assert "DataLoader over Decoding on rank 0 has 2 workers" in cause["text"]
    cpus = len(os.sched_getaffinity(0))
    if cpus - 1 - WORKERS > 0:
        assert f"Raise num_workers from 2 to {cpus - 1}" in cause["action"]
    else:
        assert "are all in use" in cause["action"]


def test_workers_that_wait_on_reads_are_idle(tmp_path):
    doc = _run(tmp_path, Remote())
    (cause,) = [c for c in doc["diagnosis"]["causes"] if c["id"] == "data_loader_workers"]
    assert cause["evidence"]["kind"] == "idle" and cause["evidence"]["workers_cpu"] < 0.3 * WORKERS
    assert "wait on reads" in cause["text"] and "prefetch_factor (now 2)" in cause["action"]
