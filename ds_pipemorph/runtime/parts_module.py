"""A DeepSpeed ``PipelineModule`` on given stage boundaries (a ``parts`` list or a parts file).

DeepSpeed cuts the layers itself (``partition_method``: ``"uniform"``, ``"parameters"``,
``"type:..."``) in ``PipelineModule._partition_layers``, which sets ``self.parts`` and this
rank's layer range. ``PartsPipelineModule`` overrides that one method to take the boundaries
``pipemorph partition`` chose; everything else (building the local layers, tied weights,
checkpointing, the engine) is DeepSpeed's own. ::

    model = PartsPipelineModule(layers, parts=[0, 7, 14, 20, 26, 32, 38, 43, 48], loss_fn=...)
    model = PartsPipelineModule.from_parts_file("parts.yaml", layers, loss_fn=...)

``num_stages`` defaults to the number of stages in ``parts``; a ``topology`` must have that many
pipeline stages.
"""
from __future__ import annotations

from deepspeed.pipe import PipelineModule

from ..fileio import BadInput
from ..plan.partition.parts import check_parts, read_parts


class PartsPipelineModule(PipelineModule):
    """``PipelineModule`` whose stage s holds layers ``parts[s]..parts[s+1]-1``."""

    def __init__(self, layers, parts, **kwargs):
        layers = list(layers)
        parts = check_parts([int(p) for p in parts], layers=len(layers))
        if kwargs.get("topology") is None:
            kwargs.setdefault("num_stages", len(parts) - 1)
        kwargs["partition_method"] = "parts"  # only shown in DeepSpeed's log line
        self._pipemorph_parts = parts  # a plain list: nn.Module stores it as an ordinary attribute
        super().__init__(layers, **kwargs)

    @classmethod
    def from_parts_file(cls, path, layers, **kwargs) -> "PartsPipelineModule":
        """The module on the boundaries of the parts file at ``path`` (BadInput if they do not
        cut ``layers`` into its stages)."""
        layers = list(layers)
        return cls(layers, read_parts(path, layers=len(layers)).parts, **kwargs)

    def _partition_layers(self, method: str = "uniform") -> None:
        parts = self._pipemorph_parts
        if len(parts) - 1 != self.num_stages:
            raise BadInput(f"parts: {len(parts) - 1} stages, but the pipeline has {self.num_stages}")
        self.parts = list(parts)
        stage_id = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=parts[stage_id], stop=parts[stage_id + 1])
