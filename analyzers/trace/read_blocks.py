"""The bytes of a trace file in blocks: plain, or gzip inflated (ISA-L where installed) within
the ceiling of `diag.inflate`, read ahead on a thread so that inflating overlaps decoding.
"""

from __future__ import annotations

import os
import queue
import threading
import types
import zlib

from diag import inflate
from diag.errors import DiagInputError

_inflate: types.ModuleType
try:  # ISA-L's inflate (python-isal) is 2-3x faster than zlib's, with the same interface
    from isal import isal_zlib as _inflate
except ImportError:
    _inflate = zlib
_INFLATE_ERRORS = (zlib.error, _inflate.error)
# python-isal's gzip reader inflates straight into a caller's buffer (no growing output
# buffer, no fresh pages per block); without it, decompressobj blocks are used.
_GzipReader = getattr(_inflate, "_GzipReader", None)

READ_BYTES = 1 << 20


def blocks(path: str):
    """Decompressed byte blocks of a .json or .json.gz file (gzip detected by magic), gzip
    within the ceiling of `diag.inflate`."""
    with open(path, "rb") as f:
        head = f.read(2)
        f.seek(0)
        if head != inflate.GZIP_MAGIC:
            while True:
                b = f.read(READ_BYTES)
                if not b:
                    return
                yield b
        limit = inflate.ceiling(os.fstat(f.fileno()).st_size)
        if _GzipReader is not None:
            yield from _reader_blocks(_GzipReader(f, READ_BYTES), path, limit)
        else:
            yield from inflate.gzip_blocks(f, path, limit, READ_BYTES, _inflate)


_QUEUE_DEPTH = 3


def _reader_blocks(reader, path: str, limit: int):
    """Blocks inflated into a ring of reused buffers. Each block is a memoryview that stays
    valid while the consumer holds it: the reader thread is at most _QUEUE_DEPTH blocks
    ahead of the block in use, and the ring is longer than that."""
    from gzip import BadGzipFile

    ring = [memoryview(bytearray(READ_BYTES * 8)) for _ in range(_QUEUE_DEPTH + 3)]
    k = total = 0
    while True:
        out = ring[k % len(ring)]
        k += 1
        try:
            n = reader.readinto(out)
        except EOFError:
            raise DiagInputError("truncated gzip file (ended before the end-of-stream marker)", source=path) from None
        except BadGzipFile as exc:
            if total and "Not a gzipped file" in str(exc):
                return  # bytes after the last member that start no other: the data ended there
            raise DiagInputError(f"corrupt gzip data ({exc})", source=path) from None
        except _INFLATE_ERRORS as exc:
            raise DiagInputError(f"corrupt gzip data ({exc})", source=path) from None
        if not n:
            return
        total += n
        if total > limit:
            raise inflate.InflateError(inflate.too_large(limit), source=path)
        yield out[:n]


def threaded(gen, depth: int = _QUEUE_DEPTH):
    """Run a block generator in a thread: zlib releases the GIL, so inflating the next
    block overlaps with decoding this one. Errors are re-raised in the consumer."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def produce():
        try:
            for item in gen:
                while not stop.is_set():
                    try:
                        q.put(("b", item), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(("end", done))
        except BaseException as exc:  # forwarded, not swallowed
            q.put(("err", exc))

    t = threading.Thread(target=produce, name="diag-trace-reader", daemon=True)
    t.start()
    try:
        while True:
            kind, item = q.get()
            if kind == "b":
                yield item
            elif kind == "err":
                raise item
            else:
                return
    finally:
        stop.set()
        while not q.empty():
            q.get_nowait()
        t.join(timeout=5)
