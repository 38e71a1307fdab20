"""Per-trace analysis as Ray tasks: `diag analyze PATH... --ray [ADDRESS]`.

Each trace is one task running the same function as the local process pool
(diag.analyzers.analyze._analyze_one); what comes back is the rank's analysis (kilobytes
of summaries, never events), and the job merge runs on those in the calling process. So
the document is the local pool's, byte for byte.

- `ray.init(address)` with an address or RAY_ADDRESS; a local Ray instance otherwise,
  shut down again at the end.
- Each task declares one CPU and the memory its trace needs (the local pool's estimate,
  capped at the largest node's), so memory-heavy traces do not oversubscribe a node.
- Files on node-local disks: one probe task per node lists which files that node holds;
  a file held by some nodes only is scheduled on one of them (node affinity). Files every
  node sees (a shared file system) go anywhere.
- A task whose worker dies is retried once by Ray (max_retries=1); a second loss makes
  the file an error, and its rank a missing rank of the merge, which goes on.
Ray is an optional extra (`pip install diag[ray]`), imported only here.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from diag.errors import DiagInputError

RETRIES = 1


def _hide_broken_amdsmi() -> None:
    """Let Ray start where the amdsmi package is installed without ROCm's libamd_smi.so.

    That package raises KeyError at import when the library is missing, and Ray's AMD
    probe catches only ImportError, in the driver and in every process Ray starts (raylet
    agents, workers). diag's tasks never use a GPU: where the import is broken, an
    `amdsmi` that raises ImportError is put first on the path of the processes Ray starts.
    """
    import contextlib
    import io

    try:
        # The bindings print their library search to stdout: not into diag's output.
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            import amdsmi  # noqa: F401
        return
    except ImportError:
        return
    except BaseException:  # noqa: BLE001 - KeyError / OSError from the bindings' library load
        pass
    sys.modules["amdsmi"] = None  # type: ignore[assignment]  # this process: `import amdsmi` raises ImportError
    shim = Path(tempfile.mkdtemp(prefix="diag-ray-")) / "amdsmi"
    shim.mkdir()
    (shim / "__init__.py").write_text('raise ImportError("amdsmi: libamd_smi.so cannot be loaded on this node")\n')
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(shim.parent), os.environ.get("PYTHONPATH")) if p)


def import_ray():
    try:
        _hide_broken_amdsmi()
        import ray
    except ImportError:
        raise DiagInputError("--ray needs Ray: pip install 'diag[ray]'") from None
    return ray


CONNECT_TIMEOUT_S = 10.0


def _check_reachable(addr: str) -> None:
    """A one-line error at once when nothing listens at a host:port (or ray://host:port) address."""
    import socket

    hostport = addr.split("://", 1)[-1]
    if ":" not in hostport or addr == "auto":
        return
    host, _, port = hostport.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except (OSError, ValueError) as exc:
        raise DiagInputError(f"Ray: cannot reach the cluster at {addr} ({getattr(exc, 'strerror', None) or exc})") from None


def _files_here(files: list[str]) -> list[bool]:
    return [os.path.isfile(f) for f in files]


class RayPool:
    """Analyses files as Ray tasks; `analyze()` returns (file, (status, value)) in file order."""

    def __init__(self, address: str | None = None, num_cpus: int | None = None):
        self.ray = ray = import_ray()
        addr = address or os.environ.get("RAY_ADDRESS") or None
        self.local = addr is None and not ray.is_initialized()
        kwargs = {"include_dashboard": False, "log_to_driver": False, "ignore_reinit_error": True,
                  "configure_logging": True, "logging_level": "ERROR"}
        if self.local:
            kwargs["num_cpus"] = num_cpus
        elif addr:
            _check_reachable(addr)  # Ray itself retries an unreachable address for minutes
        try:
            ray.init(address=addr, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any failure to start or reach a cluster is the user's input
            raise DiagInputError(f"Ray: cannot {'reach the cluster at ' + addr if addr else 'start a local instance'}"
                                 f" ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None

    def close(self) -> None:
        if self.local and self.ray.is_initialized():
            self.ray.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _alive_nodes(self) -> list[dict]:
        return [n for n in self.ray.nodes() if n.get("Alive")]

    def placement(self, files: list[str]) -> dict[str, str]:
        """file -> node id, for files that only some nodes hold."""
        nodes = self._alive_nodes()
        if len(nodes) < 2:
            return {}
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        probe = self.ray.remote(num_cpus=0)(_files_here)
        refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(files)
                for n in nodes]
        held = dict(zip((n["NodeID"] for n in nodes), self.ray.get(refs)))
        out = {}
        for i, f in enumerate(files):
            where = [node for node, have in held.items() if have[i]]
            if 0 < len(where) < len(nodes):
                out[f] = where[i % len(where)]  # spread files held by several nodes
        return out

    def analyze(self, files: list[str], fn, args: tuple, memory_of, progress=None) -> list[tuple[str, tuple]]:
        ray = self.ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        cap = max([float(n.get("Resources", {}).get("memory", 0.0)) for n in self._alive_nodes()] or [0.0])
        place = self.placement(files)
        task = ray.remote(fn)
        refs = {}
        for f in files:
            opts = {"num_cpus": 1, "max_retries": RETRIES, "retry_exceptions": False}
            mem = memory_of(f)
            if cap and mem:
                opts["memory"] = int(min(mem, cap))
            if f in place:
                opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(place[f], soft=True)
            refs[task.options(**opts).remote(f, *args)] = f
        results: dict[str, tuple] = {}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                f = refs[ref]
                try:
                    results[f] = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    results[f] = ("error", f"analysis task lost {RETRIES + 1} times ({type(exc).__name__}); "
                                           "its rank is missing from the job merge")
                if progress:
                    progress(len(results), len(files), f)
        return [(f, results[f]) for f in files]
