"""A DataLoader with workers that still keeps the step waiting: busy workers (decoding on the
CPU) told from idle ones (waiting on reads), on real single-rank runs under the agent, with
the workers' CPU read by the agent's psutil sampler."""

from __future__ import annotations

import os
import time

import pytest
import torch
from rank_documents import ranks_of

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
    assert doc.diagnosis.bound == "data", doc.diagnosis.headline
    return doc


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs for 2 workers")]


def test_workers_that_decode_on_the_cpu_are_busy(tmp_path):
    doc = _run(tmp_path, Decoding())
    (cause,) = [c for c in doc.diagnosis.causes if c["id"] == "data_loader_workers"]
    ev = cause["evidence"]
    # Two workers spinning on the CPU for every sample: about two CPUs, read by psutil; on a
    # machine whose CPUs something else takes, less, with the host's CPUs saturated.
    assert ev["kind"] == "busy"
    assert ev["workers_cpu"] >= 0.8 * WORKERS or ev["host_cpu"] >= 0.9, ev
    assert "DataLoader over Decoding on rank 0 has 2 workers" in cause["text"]
    cpus = len(os.sched_getaffinity(0))
    if cpus - 1 - WORKERS > 0 and ev["workers_cpu"] >= 0.8 * WORKERS:
        assert f"Raise num_workers from 2 to {cpus - 1}" in cause["action"]
    else:
        assert "are all in use" in cause["action"]


def test_workers_that_wait_on_reads_are_idle(tmp_path):
    doc = _run(tmp_path, Remote())
    (cause,) = [c for c in doc.diagnosis.causes if c["id"] == "data_loader_workers"]
    assert cause["evidence"]["kind"] == "idle" and cause["evidence"]["workers_cpu"] < 0.3 * WORKERS
    assert "wait on reads" in cause["text"] and "prefetch_factor (now 2)" in cause["action"]


class Samples(torch.utils.data.Dataset):
    """Samples that are cheap to read, or take 20 ms each (a slow store)."""

    def __init__(self, read_s: float):
        self.read_s = read_s

    def __len__(self):
        return 1 << 20

    def __getitem__(self, i):
        if self.read_s:
            time.sleep(self.read_s)
        return torch.full((8,), float(i))


def heavy_collate(batch):
    """Stacks the batch after 60 ms of work in the training process (per-batch decoding)."""
    time.sleep(0.06)
    return torch.stack(batch)


def _run_in_process(tmp_path, dataset, collate) -> tuple[dict, list]:
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=0, collate_fn=collate)
    model = torch.nn.Linear(8, 1)
    seen = []
    with diag.Agent(run_dir=tmp_path / "run", export=False, profile=False, report=False, nccl_log=False,
                    verbose=False, sample_interval_s=0.25) as agent:
        for _, x in zip(range(16), agent.loader(loader)):
            seen.append(x)
            model(x).sum().backward()
            agent.step(samples=4)
    return analyze_run_dir(tmp_path / "run"), seen


def test_collating_in_the_training_process_is_told_from_reading(tmp_path):
    """num_workers=0: the agent times the loader's collate_fn, so the data wait splits into
    collating (60 ms per batch here) and reading the samples; the batches are the function's own."""
    doc, seen = _run_in_process(tmp_path, Samples(0.0), heavy_collate)
    (cause,) = [c for c in doc.diagnosis.causes if c["id"] == "data_loader_no_workers"]
    ev = cause["evidence"]
    assert 60.0 <= ev["collate_ms"] <= ev["data_wait_ms"] and ev["collate_ms"] >= 0.5 * ev["data_wait_ms"]
    assert "collate_fn takes" in cause["text"] and "Collating is the larger part" in cause["action"]
    assert torch.equal(seen[0], torch.stack([torch.full((8,), float(i)) for i in range(4)]))
    steps = [s for s in ranks_of(doc)[0]["steps"] if s.get("collate_ms") is not None]
    assert len(steps) >= 15


def test_reading_in_the_training_process_is_not_called_collating(tmp_path):
    doc, _ = _run_in_process(tmp_path / "read", Samples(0.02), None)
    (cause,) = [c for c in doc.diagnosis.causes if c["id"] == "data_loader_no_workers"]
    ev = cause["evidence"]
    # Four 20 ms reads per batch; the default collate stacks four small tensors.
    assert ev["data_wait_ms"] >= 80.0 and ev["collate_ms"] < 0.1 * ev["data_wait_ms"]
    assert "Collating is the larger part" not in cause["action"]


def test_the_timed_collate_is_the_jobs_own_function_to_everything_but_the_clock():
    import pickle

    from diag.collectors.loader_facts import TimedCollate, time_collate

    times = []
    timed = TimedCollate(torch.stack, times.append)
    assert torch.equal(timed([torch.ones(2), torch.zeros(2)]), torch.stack([torch.ones(2), torch.zeros(2)]))
    assert len(times) == 1
    with pytest.raises(RuntimeError):  # the function's own error, unchanged
        timed([torch.ones(2), torch.ones(3)])
    # Pickled for a worker process: the bare function, nothing of the agent.
    assert pickle.loads(pickle.dumps(TimedCollate(torch.stack, lambda s: None))) is torch.stack

    def broken(_):
        raise ValueError("clock gone")

    failing = TimedCollate(torch.stack, broken)
    failing([torch.ones(1)])
    assert failing.on_time is None and torch.equal(failing([torch.ones(1)]), torch.ones(1, 1))
    # Only a loader that collates in this process is timed.
    with_workers = torch.utils.data.DataLoader(Samples(0.0), batch_size=2, num_workers=1)
    assert not time_collate(with_workers, times.append) and not isinstance(with_workers.collate_fn, TimedCollate)
    assert not time_collate(iter([1, 2]), times.append)
