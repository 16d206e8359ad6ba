"""Injected conditions (slow links, failures, slowed stages, varied ops) and test doubles, as a plug-in.

Never part of a normal training run's decisions: the runtime does not import this package. Importing
it registers ``plugin.PLUGIN`` with the runtime (``runtime.hooks.register_plugin``), which then
validates the ``pipemorph.inject`` section with ``section.InjectConfig`` and builds the hooks the
section asks for; ``ds_pipemorph/__init__`` imports it, so every entry point honours the section.

- ``section``: the ``pipemorph.inject`` section's models;
- ``plugin``: the plug-in (the section -> transport and engine hooks);
- ``wrapping``: explicit forwarding bases for transport wrappers (``Transport``, ``LinkControl``);
- ``delays``: injected link delays (static or a trace) as a transport wrapper, and the delay schedule
  the delegated path applies in its sender delegates;
- ``faults``: a direct link that breaks after K messages, and a router wrapper that kills a delegate;
- ``compute``: slowed stages (``inject.compute``, ``inject.compute_trace``): F, B and W of a stage wait
  (factor - 1) x their own time after they ran, counted in their op records;
- ``rank_links``: a slow link between two global ranks, on the pipeline or the all-reduce ring;
- ``vary``: per-micro-batch op times from a ``plan.sim.variation`` table (benchmarks);
- ``stock``: the same injected delays for stock DeepSpeed's p2p sends (benchmarks);
- ``emulated``: a pipeline stage whose F, B and W take fixed times around tiny real math.

Importing the package stays light (no torch): the modules that need torch load when a job asks.
"""
from ..runtime.hooks import register_plugin
from .plugin import PLUGIN

register_plugin(PLUGIN)
