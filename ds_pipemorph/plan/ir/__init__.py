"""The schedule as data: ops and their kinds (``ops``), link models (``links``), stage costs
(``profile``), which B runs fused with its W (``fused``), the lowering to per-rank streams with its
dry run (``lower``) and one stage's readiness rule (``ready_rule``). Imports nothing else of ``plan``."""
