"""Test doubles and injected conditions, never part of a normal training run's decisions.

- ``wrapping``: explicit forwarding bases for transport wrappers (``Transport``, ``LinkControl``);
- ``inject``: injected link delays (static or a trace) as a transport wrapper, and the delay schedule
  the delegated path applies in its sender delegates;
- ``faults``: a direct link that breaks after K messages, and a router wrapper that kills a delegate;
- ``stock_inject``: the same injected delays for stock DeepSpeed's p2p sends (benchmarks);
- ``emulated``: a pipeline stage whose F, B and W take fixed times around tiny real math.

The runtime builds ``inject`` and ``faults`` wrappers only when ``pipemorph.inject`` asks for them.
"""
