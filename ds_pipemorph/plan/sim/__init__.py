"""Replaying a schedule: the simulator (``simulate``, over the Python ``replay_py`` or the compiled
core ``native`` with its C source ``plancore.c``), the event-driven list scheduler the compiled core
is checked against (``listsched_py``), its timeline, the link queues the Python replays send through
(``link_queues``), the readiness replay (``ready``), incremental re-evaluation, varied op times
(``variation``), what every row must hold (``rows``) and the validity check (``validate``)."""
