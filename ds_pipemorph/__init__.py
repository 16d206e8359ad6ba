"""ds_pipemorph: straggler-resilient zero-bubble pipeline parallelism for DeepSpeed.

``ds_pipemorph.plan`` is pure Python (no torch, no deepspeed) and imports fast; the runtime
(``ds_pipemorph.initialize``) is loaded on first use.
"""
from .version import __version__

__all__ = ["__version__", "initialize"]


def __getattr__(name):
    if name == "initialize":
        from .runtime.initialize import initialize

        return initialize
    raise AttributeError(f"module 'ds_pipemorph' has no attribute {name!r}")
