"""Test doubles and injected conditions, never part of a normal training run's decisions.

- ``wrapping``: explicit forwarding bases for transport wrappers (``Transport``, ``LinkControl``);
- ``inject``: injected link delays (static or a trace) as a transport wrapper, and the delay schedule
  the delegated path applies in its sender delegates;
- ``faults``: a direct link that breaks after K messages, and a router wrapper that kills a delegate;
- ``stock_inject``: the same injected delays for stock DeepSpeed's p2p sends (benchmarks);
- ``compute_inject``: slowed stages (``inject.compute``, ``inject.compute_trace``): F, B and W of a stage wait
  (factor - 1) x their own time after they ran, counted in their op records;
- ``emulated``: a pipeline stage whose F, B and W take fixed times around tiny real math.

The runtime builds ``inject``, ``faults`` and ``compute_inject`` wrappers only when ``pipemorph.inject``
asks for them.
"""
