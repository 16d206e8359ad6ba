"""Placing ranks on the pipeline x data-parallel grid: a placement and its all-reduce cost
(``placement``), the search over placements (``placement_search``) and what each way of placing a job
predicts (``predict``); docs/placement.md."""
