"""Gzip read with a ceiling, for every reader of files diag did not write itself.

A gzip file can expand a thousandfold (a "decompression bomb"). Every reader inflates in
bounded blocks and stops with one error line once the output passes the ceiling:

    ceiling = min(DIAG_MAX_INFLATE_RATIO x the file's size, DIAG_MAX_INFLATE_BYTES)

The defaults, 100 and 64 GiB, leave room above what profiler traces and logs compress by
(30 times at most among the real traces the tests read); both environment variables raise
or lower them. Damage is handled
the same way in every reader: a corrupt deflate stream or a truncated member is one
`InflateError`, raised after the blocks before it were given, so a caller that can use a
prefix keeps it; bytes after the last member that start no other (padding, garbage) end
the data, as `gzip -d` reads them.

Imports nothing from diag but `errors`: every layer may use it.
"""

from __future__ import annotations

import io
import os
import zlib

from diag.errors import DiagInputError

GZIP_MAGIC = b"\x1f\x8b"
DEFAULT_RATIO = 100
DEFAULT_MAX_BYTES = 64 << 30
BLOCK = 8 << 20  # inflated bytes per block at most


class InflateError(DiagInputError):
    """The gzip stream is damaged or expands past the ceiling."""


def _env_number(name: str, default: int) -> int:
    try:
        value = int(float(os.environ.get(name, default)))
    except ValueError:
        return default
    return value if value > 0 else default


def ceiling(compressed_bytes: int) -> int:
    """The most inflated bytes a file of this size may give."""
    ratio = _env_number("DIAG_MAX_INFLATE_RATIO", DEFAULT_RATIO)
    return min(ratio * max(compressed_bytes, 1 << 16), _env_number("DIAG_MAX_INFLATE_BYTES", DEFAULT_MAX_BYTES))


def is_gzip(path) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == GZIP_MAGIC


def gzip_blocks(f, source: str, limit: int, read_bytes: int = 1 << 20, inflate=zlib):
    """Inflated blocks (at most BLOCK bytes each) of the gzip stream in the open binary file
    `f`, concatenated members included; InflateError past `limit` bytes or on damage."""
    errors = (zlib.error, inflate.error)
    d = inflate.decompressobj(16 + zlib.MAX_WBITS)
    total = 0
    data = b""
    while True:
        if not data:
            data = f.read(read_bytes)
            if not data:
                break
        if d.eof:  # the next member, or what some writers leave after the last (padding, garbage)
            if not data.startswith(GZIP_MAGIC[: len(data)]):
                return  # not another member: the stream ended with the last one, as gzip -d reads it
            d = inflate.decompressobj(16 + zlib.MAX_WBITS)
        try:
            out = d.decompress(data, BLOCK)
        except errors as exc:
            raise InflateError(f"corrupt gzip data ({exc})", source=source) from None
        data = d.unused_data if d.eof else d.unconsumed_tail
        if out:
            total += len(out)
            if total > limit:
                raise InflateError(too_large(limit), source=source)
            yield out
    if not d.eof:
        raise InflateError("truncated gzip file (ended before the end-of-stream marker)", source=source)


def too_large(limit: int) -> str:
    return (f"gzip data expands beyond {limit / 2**20:,.0f} MiB, more than a trace or log compresses by "
            "(a decompression bomb?); set DIAG_MAX_INFLATE_RATIO or DIAG_MAX_INFLATE_BYTES to allow more")


def read_all(path, limit: int | None = None) -> bytes:
    """A whole file's bytes, inflated when it is gzip, within the ceiling."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        if f.read(2) != GZIP_MAGIC:
            f.seek(0)
            return f.read()
        f.seek(0)
        size = os.fstat(f.fileno()).st_size
        return b"".join(gzip_blocks(f, path, ceiling(size) if limit is None else limit))


class GzipStream(io.RawIOBase):
    """A binary stream over a gzip file's inflated bytes, within the ceiling; reads raise
    InflateError where the stream is damaged (the bytes before were read already)."""

    def __init__(self, path, limit: int | None = None):
        super().__init__()
        self._file = open(path, "rb")  # noqa: SIM115 - closed by close(), as the stream is
        size = os.fstat(self._file.fileno()).st_size
        self._blocks = gzip_blocks(self._file, os.fspath(path), ceiling(size) if limit is None else limit)
        self._pending = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not len(self._pending):
            block = next(self._blocks, None)
            if block is None:
                return 0
            self._pending = memoryview(block)
        n = min(len(b), len(self._pending))
        b[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def close(self) -> None:
        if not self.closed:
            self._file.close()
        super().close()


def open_binary(path):
    """A buffered binary stream over a plain or gzip file (gzip within the ceiling)."""
    if is_gzip(path):
        return io.BufferedReader(GzipStream(path), BLOCK)
    return open(path, "rb")
