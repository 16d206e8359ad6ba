"""Profilers that write a profile file (docs/design.md contract) from measurements.

- ``linkmeasure`` / ``linkfit``: latency and bandwidth of every pipeline link over the real backend
  (``pipemorph profile-links``), giving ``links_ms``; with ``--all-pairs`` every pair of ranks in
  round-robin rounds (``pairs``), giving the link matrix of ``pipemorph place``.
- ``stages`` / ``pipecapture``: F, B and W times of each stage of a user's PipelineModule in one
  process (``pipemorph profile-stages``), giving ``compute_ms``.
- ``profileparts``: writing or merging those parts into a profile file.
"""
