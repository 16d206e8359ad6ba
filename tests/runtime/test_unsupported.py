"""The start-up refusals of settings the engine cannot train (``assembly.unsupported_reason``), on
DeepSpeed's config object as it reads them; the sentences are ``runtime.compat``'s."""
from __future__ import annotations


def test_startup_refusals_name_the_setting_to_change():
    """``unsupported_reason`` on DeepSpeed's config as it reads these settings (no ranks needed)."""
    from types import SimpleNamespace

    from ds_pipemorph.runtime.compat import TORCH_AUTOCAST_REFUSED, zero_refused
    from ds_pipemorph.runtime.assembly import unsupported_reason

    model = SimpleNamespace(mpu=lambda: SimpleNamespace(get_slice_parallel_world_size=lambda: 1))

    def config(**kw):
        base = dict(float16_config=SimpleNamespace(enabled=False), zero_optimization_stage=1,
                    torch_autocast_enabled=False)
        return SimpleNamespace(**{**base, **kw})

    assert unsupported_reason(config(), model) is None
    assert unsupported_reason(config(zero_optimization_stage=3), model) == zero_refused(3)
    assert unsupported_reason(config(torch_autocast_enabled=True), model) == TORCH_AUTOCAST_REFUSED


def test_tensor_parallel_refusals_name_the_setting_to_change():
    """``tensor_parallel.refusal`` on DeepSpeed's config and a model whose topology has 1 or 2 ranks per stage."""
    from types import SimpleNamespace

    from ds_pipemorph.runtime.compat import TP_MOVING_REFUSED, TP_PARTITIONED_REFUSED, TP_READY_REFUSED
    from ds_pipemorph.runtime.config import parse_config
    from ds_pipemorph.runtime.tensor_parallel import refusal

    def model(tp):
        return SimpleNamespace(mpu=lambda: SimpleNamespace(get_slice_parallel_world_size=lambda: tp))

    def config(partitioned):
        return SimpleNamespace(pipeline={"pipe_partitioned": partitioned, "grad_partitioned": partitioned})

    zb, ready = parse_config({"schedule": "zb"}), parse_config({"schedule": "zb", "dispatch": "ready"})
    moving = parse_config({"schedule": "zb", "rebalance": {"enabled": True}})
    assert refusal(config(True), model(1), ready) is None  # one rank per stage: nothing of this applies
    assert refusal(config(False), model(2), zb) is None
    assert refusal(config(True), model(2), zb) == TP_PARTITIONED_REFUSED  # DeepSpeed's default
    assert refusal(SimpleNamespace(pipeline={"pipe_partitioned": False, "grad_partitioned": True}), model(2),
                   zb) == TP_PARTITIONED_REFUSED
    assert refusal(config(False), model(2), ready) == TP_READY_REFUSED
    compared = parse_config({"schedule": "zb", "compare": {"schedule": "1f1b", "dispatch": "ready"}})
    assert refusal(config(False), model(2), compared) == TP_READY_REFUSED  # A/B against ready dispatch
    assert refusal(config(False), model(2), parse_config({"schedule": "zb", "compare": {"schedule": "1f1b"}})) is None
    assert refusal(config(False), model(2), moving) == TP_MOVING_REFUSED
