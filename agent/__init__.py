"""diag: training-performance diagnostics for PyTorch.

The import is kept light (no torch, no pandas) so that `import diag.analyzers`
in a worker process or `diag --help` stays fast; `diag.Agent` is resolved lazily.
"""

__version__ = "0.1.0"

__all__ = ["Agent", "__version__"]


def __getattr__(name):
    if name == "Agent":
        from diag.agent import Agent

        return Agent
    raise AttributeError(f"module 'diag' has no attribute {name!r}")
