"""diag: training-performance diagnostics for PyTorch.

The import is kept light (no torch, no numpy, no pandas) so that `import diag.analyzers`
in a worker process or `diag --help` stays fast. The documented attributes are resolved
lazily, on first use: `diag.Agent`, `diag.AgentConfig`, `diag.count_samples`, `diag.integrations`.
"""

import importlib

__version__ = "0.1.0"

# attribute -> (module, name in it, or None for the module itself)
_LAZY = {
    "Agent": ("diag.agent", "Agent"),
    "AgentConfig": ("diag.config", "AgentConfig"),
    "integrations": ("diag.integrations", None),
    "count_samples": ("diag.batches", "count_samples"),
}

__all__ = ["Agent", "AgentConfig", "__version__", "count_samples", "integrations"]


def __getattr__(name):
    if name in _LAZY:
        module, attr = _LAZY[name]
        mod = importlib.import_module(module)
        value = mod if attr is None else getattr(mod, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'diag' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
