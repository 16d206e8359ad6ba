"""When the direct path runs under NCCL's point-to-point rules (no ranks): then plans are lowered
with ``NcclLowering`` and dispatch is ordered (tests/runtime/test_nccl_double.py runs it)."""
import pytest

from ds_pipemorph.runtime.config import parse_config
from ds_pipemorph.runtime.assembly import nccl_rules
from ds_pipemorph.runtime.hooks import TransportHooks
from ds_pipemorph.runtime.plans import NCCL_READY_REFUSED, for_nccl, lowering_for
from ds_pipemorph.plan.ir.lower import LoweringPolicy
from ds_pipemorph.plan.ir.nccl_lowering import NcclLowering


class NcclDouble(TransportHooks):
    p2p_rules = "nccl"


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
@pytest.mark.parametrize("mode", ["off", "auto"])
def test_nccl_backend_puts_direct_links_under_nccl_rules(backend, mode):
    assert nccl_rules(backend, mode)


@pytest.mark.parametrize("mode", ["off", "auto"])
def test_a_plugin_double_puts_gloo_direct_links_under_nccl_rules(mode):
    assert nccl_rules("gloo", mode, [TransportHooks(), NcclDouble()])
    assert not nccl_rules("gloo", mode, [TransportHooks()])


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_every_link_delegated_keeps_tag_matching(backend):
    assert not nccl_rules(backend, "always", [NcclDouble()])


def test_under_nccl_rules_plans_lower_with_the_nccl_lowering_keeping_the_fused_backward():
    cfg = parse_config({"schedule": "zb"})
    assert lowering_for(cfg) == LoweringPolicy()
    assert lowering_for(cfg, nccl=True) == NcclLowering()
    assert for_nccl(LoweringPolicy(recv_window=1, fused=True)) == NcclLowering(fused=True)
    assert "set pipemorph.dispatch to \"ordered\"" in NCCL_READY_REFUSED
