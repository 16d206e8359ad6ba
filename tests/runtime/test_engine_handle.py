"""The handle ``initialize`` returns with ``orchestrate.matrix`` stands for the engine in force,
class checks included."""
from __future__ import annotations

from ds_pipemorph.runtime.engine_handle import EngineHandle


class FirstEngine:
    pending_remap = None

    def __init__(self):
        self.steps = 0

    def train_batch(self, data_iter=None):
        self.steps += 1
        return 0.5


class SecondEngine(FirstEngine):
    pass


def test_the_handle_passes_class_checks_and_attribute_access_to_the_engine_in_force():
    first = FirstEngine()
    handle = EngineHandle(first)
    assert isinstance(handle, FirstEngine) and not isinstance(handle, SecondEngine)
    assert handle.train_batch() == 0.5 and first.steps == 1
    handle.lr = 0.1  # written through to the engine
    assert first.lr == 0.1
    object.__setattr__(handle, "_engine", SecondEngine())  # what a successful re-mapping does
    assert isinstance(handle, SecondEngine) and handle.steps == 0
    assert type(handle) is EngineHandle and handle.engine is not first
