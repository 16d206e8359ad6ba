"""ds_pipemorph: straggler-resilient zero-bubble pipeline parallelism for DeepSpeed.

``ds_pipemorph.plan`` is pure Python (no torch, no deepspeed); the runtime
(``ds_pipemorph.initialize``) is loaded on first use. The injection plug-in (``ds_pipemorph.inject``,
torch-free to import) is registered here, above the runtime, which never imports it: any use of the
package honours the ``pipemorph.inject`` section.
"""
from . import inject as _inject  # noqa: F401  (registers the plug-in with runtime.hooks)
from .version import __version__

__all__ = ["__version__", "initialize"]


def __getattr__(name):
    if name == "initialize":
        from .runtime.initialize import initialize

        return initialize
    raise AttributeError(f"module 'ds_pipemorph' has no attribute {name!r}")
