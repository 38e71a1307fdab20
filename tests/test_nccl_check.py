"""`diag nccl`'s result check and memory budget: nccl-tests' rules, within bounded memory."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import numpy as np
import pytest
import torch
import torch.distributed as dist

from diag.collectors import nccl_bench as nb
from diag.collectors import nccl_case, nccl_sizes

GIB = 1 << 30


def test_memory_limit_is_nccl_tests_rule():
    # A 16 GiB device: 1 GiB reserved, 1 GiB for the library, three buffers when checking.
    assert nb.memory_limit(16 * GIB, 16 * GIB, check=True) == 14 * GIB // 3
    assert nb.memory_limit(16 * GIB, 16 * GIB, check=False) == 7 * GIB
    # An 80 GB H100: the reserve stops at 4 GiB.
    h100 = 85_520_809_984
    assert nb.memory_limit(h100, h100, check=True) == (h100 - 4 * GIB - GIB) // 3
    # Memory the process already holds counts: 10 GiB free of 80.
    assert nb.memory_limit(80 * GIB, 10 * GIB, check=True) == 9 * GIB // 3
    assert nb.memory_limit(GIB, GIB, check=True) == 0


def test_warm_up_visits_every_size_by_a_factor_of_two():
    assert nb.warmup_sizes(8, 128) == [8, 16, 32, 64, 128]
    assert nb.warmup_sizes(1000, 5000) == [1000, 2000, 4000]
    assert nb.warmup_sizes(0, 4) == [0, 1, 2, 4]


# ---------------------------------------------------------------- the check, element by element


def _value(rank, index, world, redop):
    """The inputs the benchmark writes, as numbers (an independent statement of `nccl_case.Case._values`)."""
    index = np.asarray(index, dtype=np.int64)
    if redop == "prod":
        return 1 + ((index + rank) % world == 0).astype(np.int64)
    return (index * 7 + rank * 3) % 5 + 1


def _reduced(index, world, redop):
    vals = np.stack([_value(j, index, world, redop) for j in range(world)])
    if redop == "sum":
        return vals.sum(0)
    if redop == "prod":
        return vals.prod(0)
    if redop == "max":
        return vals.max(0)
    if redop == "min":
        return vals.min(0)
    return vals.sum(0) / world


def _correct_output(coll, c, rank, world, root, redop):
    """What each collective leaves in this rank's receive buffer, from nccl-tests' definitions."""
    if coll == "all_reduce" or (coll == "reduce" and rank == root):
        return _reduced(np.arange(c.recv), world, redop)
    if coll == "broadcast":
        return _value(root, np.arange(c.recv), world, redop)
    if coll == "all_gather":
        return np.concatenate([_value(j, np.arange(c.send), world, redop) for j in range(world)])
    if coll == "reduce_scatter":
        return _reduced(rank * c.param + np.arange(c.param), world, redop)
    if coll == "alltoall":
        return np.concatenate([_value(j, rank * c.param + np.arange(c.param), world, redop)
                               for j in range(world)])
    if coll == "sendrecv":
        return _value((rank - 1) % world, np.arange(c.recv), world, redop)
    return None


def _case(coll, dtype, redop, rank=1, world=3, size=4000):
    comm = types.SimpleNamespace(torch=torch, dist=dist, device=torch.device("cpu"), rank=rank, world=world,
                                 backend="gloo", group=None)
    case = nccl_case.Case(comm, coll, dtype, redop, root=2, max_bytes=size)
    case.setup(size)
    return case


@pytest.mark.parametrize("coll", nb.COLLECTIVES)
@pytest.mark.parametrize("dtype,redop", [("float", "sum"), ("int8", "max"), ("bfloat16", "prod"),
                                         ("half", "avg"), ("uint8", "min")])
def test_the_check_accepts_the_right_output_and_counts_each_wrong_element(monkeypatch, coll, dtype, redop):
    monkeypatch.setattr(nccl_case, "CHECK_CHUNK", 7)  # chunks that end inside every segment
    case = _case(coll, dtype, redop)
    want = _correct_output(coll, case.counts, 1, 3, 2, case.redop_name)
    for in_place in (False, True):
        if not case.checkable(in_place):
            continue
        expected = case.prepare(in_place)
        if want is None:  # a non-root rank of reduce: nothing to check
            assert expected is None
            continue
        _, recv = case.views(in_place)
        assert recv.numel() == len(want)
        recv.copy_(torch.from_numpy(np.asarray(want)).to(recv.dtype))
        assert case.count_wrong(expected, in_place) == 0, (coll, in_place)
        for pos in (0, len(want) // 2, len(want) - 1):
            recv[pos] += 3
        assert case.count_wrong(expected, in_place) == 3, (coll, in_place)


# ---------------------------------------------------------------- a whole run within a memory budget


_PEAK_RSS = (
    "import resource, runpy, sys\n"
    "sys.argv = ['diag'] + sys.argv[1:]\n"
    "try:\n"
    "    runpy.run_module('diag', run_name='__main__')\n"
    "except SystemExit as exc:\n"
    "    code = exc.code\n"
    "print('PEAK_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
    "sys.exit(code)\n"
)


def _peak_rss_run(tmp_path, budget: str, *args) -> tuple[subprocess.CompletedProcess, int]:
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", **({nccl_sizes.MEMORY_ENV: budget} if budget else {}))
    proc = subprocess.run([sys.executable, "-c", _PEAK_RSS, "nccl", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    peak = [int(line.split()[1]) * 1024 for line in proc.stderr.splitlines() if line.startswith("PEAK_KB")]
    return proc, peak[0]


@pytest.mark.slow
def test_a_sweep_past_the_memory_budget_stops_where_nccl_tests_would_and_stays_inside_it(tmp_path):
    # An emulated 3.5 GiB device: (3.5 - 1 - 1) / 3 = 512 MiB per buffer. `-e 8G` asks for 16
    # times that; before the limit and the chunked check the run held two 8 GiB buffers and
    # int64 expectations of several times the message.
    out = tmp_path / "bench.json"
    proc, peak = _peak_rss_run(tmp_path, "3584M", "-b", "128M", "-e", "8G", "-f", "4", "-n", "1", "-w", "0",
                               "-c", "1", "--collective", "all_reduce", "--json", str(out), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    limit = 512 << 20
    assert f"# Reducing maxBytes to {limit} due to memory limitation" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["memory_limit_bytes"] == limit and doc["params"]["max_bytes"] == limit
    rows = doc["tests"][0]["rows"]
    assert [r["size_bytes"] for r in rows] == [128 << 20, 512 << 20]
    assert all(r[k]["wrong"] == 0 for r in rows for k in ("out_of_place", "in_place"))
    # The same process with the smallest message only: torch, gloo and the interpreter.
    base_proc, base = _peak_rss_run(tmp_path, "", "-b", "8", "-e", "8", "-n", "1", "-w", "0",
                                    "--collective", "all_reduce", "--no-progress")
    assert base_proc.returncode == 0, base_proc.stderr
    # Two 512 MiB buffers, and the check's chunks on top: nothing near another buffer's size.
    assert peak - base < 2 * limit + (256 << 20), (peak, base)
