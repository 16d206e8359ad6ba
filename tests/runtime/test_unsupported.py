"""The start-up refusals of settings the engine cannot train (``engine.unsupported_reason``), on
DeepSpeed's config object as it reads them; the sentences are ``runtime.compat``'s."""
from __future__ import annotations


def test_startup_refusals_name_the_setting_to_change():
    """``unsupported_reason`` on DeepSpeed's config as it reads these settings (no ranks needed)."""
    from types import SimpleNamespace

    from ds_pipemorph.runtime.compat import TORCH_AUTOCAST_REFUSED, zero_refused
    from ds_pipemorph.runtime.engine import unsupported_reason

    model = SimpleNamespace(mpu=lambda: SimpleNamespace(get_slice_parallel_world_size=lambda: 1))

    def config(**kw):
        base = dict(float16_config=SimpleNamespace(enabled=False), zero_optimization_stage=1,
                    torch_autocast_enabled=False)
        return SimpleNamespace(**{**base, **kw})

    assert unsupported_reason(config(), model) is None
    assert unsupported_reason(config(zero_optimization_stage=3), model) == zero_refused(3)
    assert unsupported_reason(config(torch_autocast_enabled=True), model) == TORCH_AUTOCAST_REFUSED
