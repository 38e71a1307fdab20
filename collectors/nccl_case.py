"""One (collective, dtype, redop) test of `diag nccl`: its buffers, its call and its check,
compared a chunk at a time so that the check fits where nccl-tests' does.
"""

from __future__ import annotations

from diag.collectors.nccl_comm import Comm
from diag.collectors.nccl_sizes import REDUCING, ROOTED, Counts, coll_counts

# Elements a result check fills or compares at once: its temporaries (int64) stay near
# 32 MiB each whatever the message size, as nccl-tests' check kernels need no copy at all.
CHECK_CHUNK = 1 << 22

def _torch_dtype(torch, name: str):
    return {
        "int8": torch.int8, "uint8": torch.uint8, "int32": torch.int32, "uint32": torch.uint32,
        "int64": torch.int64, "uint64": torch.uint64, "half": torch.float16, "float": torch.float32,
        "double": torch.float64, "bfloat16": torch.bfloat16,
    }[name]


def _redop(dist, name: str):
    return {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "max": dist.ReduceOp.MAX,
            "min": dist.ReduceOp.MIN, "avg": dist.ReduceOp.AVG}[name]


class Case:
    """One (collective, dtype, redop) test: its buffers, its call and its check."""

    def __init__(self, comm: Comm, collective: str, dtype: str, redop: str, root: int, max_bytes: int):
        torch = comm.torch
        self.comm = comm
        self.collective = collective
        self.dtype_name = dtype
        self.redop_name = redop if collective in REDUCING else "none"
        self.dtype = _torch_dtype(torch, dtype)
        self.elt = torch.empty((), dtype=self.dtype).element_size()
        self.root = root if collective in ROOTED else -1
        self.op = _redop(comm.dist, redop) if collective in REDUCING else None
        big = coll_counts(collective, max_bytes, self.elt, comm.world)
        n = max(big.send, big.recv, 1)
        self.sendbuf = torch.zeros(n, dtype=self.dtype, device=comm.device)
        self.recvbuf = torch.zeros(n, dtype=self.dtype, device=comm.device)
        self.counts = big
        # torch 2.13 renamed the tensor forms (*_single); older releases only have *_tensor.
        dist = comm.dist
        self._all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    # -- buffers

    def setup(self, size_bytes: int) -> Counts:
        self.counts = coll_counts(self.collective, size_bytes, self.elt, self.comm.world)
        return self.counts

    def views(self, in_place: bool):
        c, r = self.counts, self.comm.rank
        if in_place:
            send = self.recvbuf.narrow(0, c.send_inplace_offset * r, c.send)
            recv = self.recvbuf.narrow(0, c.recv_inplace_offset * r, c.recv)
        else:
            send = self.sendbuf.narrow(0, 0, c.send)
            recv = self.recvbuf.narrow(0, 0, c.recv)
        return send, recv

    # -- the call

    def call(self, send, recv) -> None:
        dist, coll, g = self.comm.dist, self.collective, self.comm.group
        if coll == "all_reduce":
            dist.all_reduce(recv, op=self.op, group=g)
        elif coll == "all_gather":
            self._all_gather(recv, send, group=g)
        elif coll == "reduce_scatter":
            self._reduce_scatter(recv, send, op=self.op, group=g)
        elif coll == "alltoall":
            dist.all_to_all_single(recv, send, group=g)
        elif coll == "broadcast":
            dist.broadcast(recv, self.root, group=g)
        elif coll == "reduce":
            dist.reduce(recv, self.root, op=self.op, group=g)
        elif coll == "sendrecv":
            n, r = self.comm.world, self.comm.rank
            ops = [dist.P2POp(dist.isend, send, (r + 1) % n, group=g),
                   dist.P2POp(dist.irecv, recv, (r - 1) % n, group=g)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    # -- data and check

    def _values(self, rank: int, start: int, count: int):
        """Rank-dependent inputs whose reductions are exact in every data type (int64)."""
        torch, n = self.comm.torch, self.comm.world
        idx = torch.arange(start, start + count, dtype=torch.int64, device=self.comm.device)
        if self.redop_name == "prod":
            vals = 1 + ((idx + rank) % max(n, 1) == 0).to(torch.int64)
        else:
            vals = (idx * 7 + rank * 3) % 5 + 1
        return vals

    def _period(self) -> int:
        """Every input and every result repeats along the buffer with this period."""
        return max(self.comm.world, 1) if self.redop_name == "prod" else 5

    def _reduced(self, start: int, count: int):
        """The reduction over every rank's input, in the data type."""
        torch = self.comm.torch
        acc = self._values(0, start, count).clone()
        for j in range(1, self.comm.world):
            v = self._values(j, start, count)
            if self.redop_name in ("sum", "avg"):
                acc += v
            elif self.redop_name == "prod":
                acc *= v
            elif self.redop_name == "max":
                acc = torch.maximum(acc, v)
            else:
                acc = torch.minimum(acc, v)
        if self.redop_name == "avg":
            return (acc.to(torch.float64) / self.comm.world).to(self.dtype)
        return acc.to(self.dtype)

    def _series(self, source: int | None, start: int, count: int):
        """Elements start .. start + count of rank `source`'s input (None: of the reduction), in the
        data type: one period computed, then repeated, so a fill or a check runs at copy speed."""
        period = self._period()
        if source is None:
            one = self._reduced(start, period)
        else:
            one = self._values(source, start, period).to(self.dtype)
        return one.repeat(-(-count // period)).narrow(0, 0, count)

    def checkable(self, in_place: bool) -> bool:
        return not (in_place and self.collective in ("alltoall", "sendrecv"))

    def _fill(self, dst, rank: int, start: int) -> None:
        """dst[k] = `rank`'s input at element start + k, a chunk at a time."""
        total = dst.numel()
        for off in range(0, total, CHECK_CHUNK):
            n = min(CHECK_CHUNK, total - off)
            dst.narrow(0, off, n).copy_(self._series(rank, start + off, n))

    def prepare(self, in_place: bool):
        """Fill the inputs; return what this rank's output should hold (None: not checked here).

        The expectation is a list of segments (output offset, count, source rank or None for
        the reduction over all ranks, source offset), computed a chunk at a time when checked,
        so a check never holds more than a chunk beyond the two buffers."""
        c, r, n = self.counts, self.comm.rank, self.comm.world
        send, recv = self.views(in_place)
        coll = self.collective
        if not in_place:
            recv.zero_()
        self._fill(send, r, 0)
        if coll in ("all_reduce", "broadcast", "reduce"):
            # In-place-only calls: the receive buffer carries the input.
            if coll == "broadcast" and r != self.root:
                recv.zero_()
            elif not in_place:
                recv.copy_(send)
            if coll == "broadcast":
                return [(0, c.recv, self.root, 0)]
            if coll == "reduce" and r != self.root:
                return None
            return [(0, c.recv, None, 0)]
        if coll == "all_gather":
            return [(j * c.send, c.send, j, 0) for j in range(n)]
        if coll == "reduce_scatter":
            return [(0, c.param, None, r * c.param)]
        if coll == "alltoall":
            return [(j * c.param, c.param, j, r * c.param) for j in range(n)]
        if coll == "sendrecv":
            return [(0, c.recv, (r - 1) % n, 0)]
        return None

    def count_wrong(self, expected, in_place: bool) -> int:
        if expected is None:
            return 0
        torch = self.comm.torch
        _, recv = self.views(in_place)
        wrong = torch.zeros((), dtype=torch.int64, device=self.comm.device)
        for offset, count, source, source_start in expected:
            for off in range(0, count, CHECK_CHUNK):
                n = min(CHECK_CHUNK, count - off)
                want = self._series(source, source_start + off, n)
                wrong += self._mismatches(recv.narrow(0, offset + off, n), want)
        return int(wrong.item())  # one device sync per check, not one per chunk

    def _mismatches(self, got, want):
        torch = self.comm.torch
        if not self.dtype.is_floating_point:
            return torch.count_nonzero(got != want)
        tol = {torch.float16: 1e-2, torch.bfloat16: 2e-2}.get(self.dtype, 1e-6)
        wide = torch.float64 if self.dtype == torch.float64 else torch.float32
        want = want.to(wide)
        # Written so that a NaN or an infinity received counts as wrong.
        return torch.count_nonzero(~((got.to(wide) - want).abs() <= tol * want.abs()))
