"""Cutting a model's layers into stages: the layer profile (``layer_profile``), the parts list and
its file (``parts``), and the partition search (``partition``); docs/partition.md."""
