"""The weight-gradient store (``runtime.wgrad_store``), in one process: Linear and LayerNorm layers
leave their weight gradients to W as tensors. The gradients equal the stock module's fused backward
(an independent computation: the same weights without the store), every parameter's accumulation
hook fires once per W, and a stage whose parameters all defer frees its graph in B."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from ds_pipemorph.runtime import wgrad_store
from ds_pipemorph.runtime.act_meter import SavedBytes, tensor_bytes
from ds_pipemorph.runtime.bw_split import backward_input

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes" / "gpt"))
from model import Block  # noqa: E402


def _gpt_stage(dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(Block(32, 4), Block(32, 4), torch.nn.LayerNorm(32)).to(dtype)


class TiedHead(torch.nn.Module):
    """A Linear whose weight a later op uses again directly (as a tied output head does)."""

    def __init__(self):
        super().__init__()
        self.lin, self.norm = torch.nn.Linear(16, 16), torch.nn.LayerNorm(16)

    def forward(self, x):
        h = self.norm(torch.tanh(self.lin(x)))
        return torch.nn.functional.linear(h, self.lin.weight)


def _split(stage, xs, gys):
    params = [p for p in stage.parameters() if p.requires_grad]
    works, dxs = [], []
    for x, gy in zip(xs, gys):
        x = x.clone().requires_grad_()
        (dx,), work = backward_input([stage(x)], [gy], [x], params)
        dxs.append(dx)
        works.append(work)
    for work in works:
        work.run()
    return dxs


def _fused(stage, xs, gys):
    dxs = []
    for x, gy in zip(xs, gys):
        x = x.clone().requires_grad_()
        torch.autograd.backward(stage(x), gy)
        dxs.append(x.grad)
    return dxs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpt_blocks_give_the_fused_gradients_and_every_layer_defers(dtype):
    stock = _gpt_stage(dtype)
    stage = copy.deepcopy(stock)
    assert wgrad_store.install(stage) == 13  # 4 Linear + 2 LayerNorm per block, the final norm
    xs = [torch.randn(2, 8, 32, dtype=dtype) for _ in range(3)]
    gys = [torch.randn(2, 8, 32, dtype=dtype) for _ in range(3)]
    want_dx = _fused(stock, xs, gys)
    x = xs[0].clone().requires_grad_()
    _, work = backward_input([stage(x)], [gys[0]], [x], list(stage.parameters()))
    assert not work.groups and len(work.store.entries) == 13  # nothing of the graph is re-entered
    work.run()
    stage.zero_grad(set_to_none=True)
    got_dx = _split(stage, xs, gys)
    for a, b in zip(got_dx, want_dx):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for p, q in zip(stage.parameters(), stock.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)  # the same kernels, in the same order


def test_a_weight_also_used_outside_its_layer_goes_through_the_graph_and_accumulates_once():
    stock = TiedHead()
    stage = copy.deepcopy(stock)
    wgrad_store.install(stage)
    fired = {name: 0 for name, _ in stage.named_parameters()}
    for name, p in stage.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, name=name: fired.__setitem__(name, fired[name] + 1))
    xs, gys = [torch.randn(4, 16)], [torch.randn(4, 16)]
    want_dx = _fused(stock, xs, gys)
    x = xs[0].clone().requires_grad_()
    (dx,), work = backward_input([stage(x)], gys, [x], list(stage.parameters()))
    # The norm defers; the Linear's weight is also the head's, so the Linear's node is W's to re-enter.
    assert len(work.store.entries) == 1 and len(work.groups) == 1
    assert {id(p) for p in work.store.entries[0][3]} == {id(stage.norm.weight), id(stage.norm.bias)}
    assert all(v == 0 for v in fired.values())
    work.run()
    assert fired == {name: 1 for name in fired}  # once per parameter, as after a fused backward
    torch.testing.assert_close(dx, want_dx[0])
    for p, q in zip(stage.parameters(), stock.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_a_stage_whose_parameters_all_defer_frees_its_graph_in_b_and_keeps_only_what_w_needs():
    stage = _gpt_stage(torch.float32)
    wgrad_store.install(stage)
    kept: list[torch.Tensor] = []  # what W needs, recorded independently: each Linear's input ...
    for m in stage.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(lambda m, args, out: kept.append(args[0]))
    x = torch.randn(2, 8, 32, requires_grad=True)
    with SavedBytes(stage.parameters()) as meter:
        y = stage(x)
        after_f = meter.live
        norms = sum(isinstance(m, torch.nn.LayerNorm) for m in stage.modules())
        (dx,), work = backward_input([y], [torch.randn_like(y)], [x], list(stage.parameters()))
        del y
        # ... and each LayerNorm's weight and bias gradients, computed in B (fp32, width 32)
        want = tensor_bytes(kept) + norms * 2 * 32 * 4
        assert meter.live == want < after_f
        work.run()
        del work
        assert meter.live == 0


@pytest.mark.parametrize("case", ["no bias", "frozen weight"])
def test_a_layer_norm_with_one_parameter_to_learn_defers_it_alone(case):
    stock = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8, bias=case != "no bias"))
    if case == "frozen weight":
        stock[1].weight.requires_grad_(False)
    stage = copy.deepcopy(stock)
    wgrad_store.install(stage)
    xs, gys = [torch.randn(4, 8)], [torch.randn(4, 8)]
    want_dx = _fused(stock, xs, gys)
    got_dx = _split(stage, xs, gys)
    torch.testing.assert_close(got_dx[0], want_dx[0])
    for p, q in zip(stage.parameters(), stock.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad)


def test_without_grad_or_under_autocast_the_layers_run_as_stock():
    lin, norm = torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)
    seq = torch.nn.Sequential(lin, norm)
    wgrad_store.install(seq)
    x = torch.randn(2, 8, requires_grad=True)
    assert type(seq(x).grad_fn) in wgrad_store.NODE_TYPES
    with torch.no_grad():
        assert seq(x).grad_fn is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert type(lin(x).grad_fn) not in wgrad_store.NODE_TYPES
    wgrad_store.uninstall(seq)
    assert "forward" not in lin.__dict__ and "forward" not in norm.__dict__
    assert type(seq(x).grad_fn).__name__ == "NativeLayerNormBackward0"
