"""Files written whole or not at all, and read within bounds: the primitives under the run directory.

A document is written to a temporary name beside its place and renamed into it, so a reader
never sees half a file and a crash never corrupts what was written. A claim between ranks is
created exclusively, whole. A reader opens regular files only and reads no more than a bound.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from pathlib import Path


def _written_beside(path: Path, data: bytes, durable: bool = True) -> str:
    """`data` in a temporary file next to `path` (same file system), flushed to disk when `durable`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
    except BaseException:
        _unlink(tmp)
        raise
    return tmp


def _unlink(tmp: str) -> None:
    try:
        os.unlink(tmp)
    except OSError:
        pass


def atomic_write_bytes(path: str | os.PathLike, data: bytes, durable: bool = True) -> None:
    """`data` at `path`, whole or not at all for any reader; `durable=False` skips the flush to
    disk, for a file rewritten every second whose loss in a crash costs nothing (live.json)."""
    tmp = _written_beside(Path(path), data, durable)
    try:
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise


def create_exclusive(path: str | os.PathLike, data: bytes) -> bool:
    """Create `path` holding `data`, whole or not at all; False when it exists already.

    Claims and agreements between ranks rest on this. O_EXCL alone creates the file empty
    and fills it afterwards, and a peer reading in between sees a partial claim. Here the
    data is written under a temporary name first and hard-linked into place, which fails
    if the name is taken. File systems without hard links get an exclusive lock directory
    (`<name>.lock`, mkdir is atomic everywhere) and an atomic rename instead.
    """
    path = Path(path)
    tmp = _written_beside(path, data)
    try:
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        except OSError:
            pass  # no hard links here (some FUSE and object-store mounts)
        try:
            os.mkdir(path.with_name(path.name + ".lock"))
        except FileExistsError:
            return False
        if path.exists():
            return False
        os.replace(tmp, path)
        return True
    finally:
        _unlink(tmp)


def is_claim_part(name: str, claim: str) -> bool:
    """The claim file itself or a temporary or lock of `create_exclusive` for it."""
    return name == claim or name == claim + ".lock" or (name.startswith(f".{claim}.") and name.endswith(".tmp"))


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj, durable: bool = True) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, default=json_default) + "\n").encode("utf-8"), durable)


def json_default(obj):
    # numpy scalars and paths appear in records; everything else is a bug worth seeing.
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def open_regular(path: str | os.PathLike):
    """A regular file opened for reading, binary. A device, FIFO or socket (a link to /dev/zero,
    a named pipe) is refused with OSError before any read: its size says nothing of how much
    it yields, and a FIFO's open would block until a writer came."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


# The run directory's JSON documents are a few kB; one this large is not the agent's.
MAX_JSON_BYTES = 64 << 20


def read_json(path: str | os.PathLike, problems: list | None = None, max_bytes: int = MAX_JSON_BYTES) -> dict | None:
    try:
        with open_regular(path) as f:
            # Read no more than the bound, whatever the size says (a file can grow while read).
            data = f.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise ValueError(f"larger than {max_bytes >> 20} MiB")
        obj = json.loads(data)
        return obj if isinstance(obj, dict) else None
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: nested deeper than json can follow
        if problems is not None:
            problems.append(f"{path}: unreadable JSON ({type(exc).__name__ if isinstance(exc, RecursionError) else exc})")
        return None
