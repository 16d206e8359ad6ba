"""The weight-gradient store (``runtime.wgrad_store``), in one process: the Linear and LayerNorm
layers of stock modules and the parameters one elementwise op applies, recognised in their graph, leave W their weight GEMMs as tensors. The
gradients equal a fused backward of the same module bit for bit (an independent computation: a
copy of the weights, ``torch.autograd.backward``), every parameter's accumulation hook fires once
per W, and a stage whose parameters all go this way frees its graph in B."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from ds_pipemorph.runtime import wgrad_store
from ds_pipemorph.runtime.act_meter import SavedBytes, tensor_bytes
from ds_pipemorph.runtime import bw_split
from ds_pipemorph.runtime.bw_split import backward_input

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes" / "gpt"))
from model import Block  # noqa: E402


def _gpt_stage(dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(Block(32, 4), Block(32, 4), torch.nn.LayerNorm(32)).to(dtype)


class TiedHead(torch.nn.Module):
    """A Linear whose weight a later op uses again, not as a Linear's (untransposed)."""

    def __init__(self):
        super().__init__()
        self.lin, self.norm = torch.nn.Linear(16, 16), torch.nn.LayerNorm(16)

    def forward(self, x):
        h = self.norm(torch.tanh(self.lin(x)))
        return h @ self.lin.weight


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


def _split_equals_fused_bit_for_bit(stage, stock, xs, gys, want_dx) -> None:
    """From fresh gradients, B + W of every micro-batch on ``stage`` gives exactly the input and
    parameter gradients the fused backward gave on ``stock`` (``want_dx``, ``stock``'s ``.grad``)."""
    stage.zero_grad(set_to_none=True)
    got_dx = _split(stage, xs, gys)
    for a, b in zip(got_dx, want_dx):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for p, q in zip(stage.parameters(), stock.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def _linears(stage) -> list:
    return [m for m in stage.modules() if isinstance(m, torch.nn.Linear)]


def _in_b(stage) -> int:
    """How many parameters B computes the gradients of: every bias, every LayerNorm parameter."""
    return sum(m.bias is not None for m in _linears(stage)) + sum(
        (m.weight is not None) + (m.bias is not None) for m in stage.modules() if isinstance(m, torch.nn.LayerNorm))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpt_blocks_give_the_fused_gradients_and_every_layer_is_the_stores(dtype):
    stock = _gpt_stage(dtype)
    stage = copy.deepcopy(stock)
    xs = [torch.randn(2, 8, 32, dtype=dtype) for _ in range(3)]
    gys = [torch.randn(2, 8, 32, dtype=dtype) for _ in range(3)]
    want_dx = _fused(stock, xs, gys)
    x = xs[0].clone().requires_grad_()
    _, work = backward_input([stage(x)], [gys[0]], [x], list(stage.parameters()))
    assert not work.groups  # nothing of the graph is re-entered
    assert len(work.store.linears) == len(_linears(stage)) == 8 and len(work.store.in_b) == _in_b(stage) == 18
    work.run()
    _split_equals_fused_bit_for_bit(stage, stock, xs, gys, want_dx)  # the same kernels, in the same order


def test_a_weight_also_used_outside_its_layer_goes_through_the_graph_and_accumulates_once():
    stock = TiedHead()
    stage = copy.deepcopy(stock)
    fired = {name: 0 for name, _ in stage.named_parameters()}
    for name, p in stage.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, name=name: fired.__setitem__(name, fired[name] + 1))
    xs, gys = [torch.randn(4, 16)], [torch.randn(4, 16)]
    want_dx = _fused(stock, xs, gys)
    x = xs[0].clone().requires_grad_()
    params = list(stage.parameters())
    (dx,), work = backward_input([stage(x)], gys, [x], params)
    # The norm is the store's; the Linear's weight is also the product's, so its node is W's to re-enter.
    assert not work.store.linears and len(work.groups) == 1
    assert {id(params[k]) for k in work.store.in_b} == {id(stage.norm.weight), id(stage.norm.bias)}
    assert all(v == 0 for v in fired.values())
    work.run()
    assert fired == {name: 1 for name in fired}  # once per parameter, as after a fused backward
    torch.testing.assert_close(dx, want_dx[0])
    for p, q in zip(stage.parameters(), stock.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_a_stage_whose_parameters_all_go_to_the_store_frees_its_graph_in_b_and_keeps_only_what_w_needs():
    stage = _gpt_stage(torch.float32)
    kept: list[torch.Tensor] = []  # what W needs, recorded independently: each Linear's input ...
    grads = 0  # ... and, beside it, the gradient at each Linear's output and the gradients B computed
    for m in _linears(stage):
        m.register_forward_hook(lambda m, args, out: kept.append(args[0]))
        grads += 2 * 8 * m.out_features * 4 + (m.out_features * 4 if m.bias is not None else 0)
    grads += sum(p.numel() * 4 for m in stage.modules() if isinstance(m, torch.nn.LayerNorm) for p in m.parameters())
    x = torch.randn(2, 8, 32, requires_grad=True)
    with SavedBytes(stage.parameters()) as meter:
        y = stage(x)
        after_f = meter.live
        (dx,), work = backward_input([y], [torch.randn_like(y)], [x], list(stage.parameters()))
        del y
        assert meter.live == tensor_bytes(kept) < after_f
        assert tensor_bytes(work.kept_grads()) == grads
        work.run()
        del work
        assert meter.live == 0


@pytest.mark.parametrize("case", ["no bias", "frozen weight"])
def test_a_layer_norm_with_one_parameter_to_learn_leaves_it_alone_to_the_store(case):
    stock = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8, bias=case != "no bias"))
    if case == "frozen weight":
        stock[1].weight.requires_grad_(False)
    stage = copy.deepcopy(stock)
    xs, gys = [torch.randn(4, 8)], [torch.randn(4, 8)]
    want_dx = _fused(stock, xs, gys)
    got_dx = _split(stage, xs, gys)
    torch.testing.assert_close(got_dx[0], want_dx[0])
    for p, q in zip(stage.parameters(), stock.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad)


class _RMSNorm(torch.nn.Module):
    """A hand-written RMSNorm (a scale multiplied with the activation), then a shift subtracted, and
    a bias added twice, which stays the graph's (one parameter, two elementwise nodes)."""

    def __init__(self, d: int):
        super().__init__()
        self.scale, self.shift = torch.nn.Parameter(torch.rand(d) + 0.5), torch.nn.Parameter(torch.randn(d))
        self.twice = torch.nn.Parameter(torch.randn(d))

    def forward(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.scale - self.shift
        return torch.tanh(h + self.twice) + self.twice


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_elementwise_parameters_are_the_stores_and_a_torch_encoder_layer_frees_its_graph_in_b(dtype):
    # nn.MultiheadAttention's packed input projection adds its bias apart from its GEMM (an MmBackward0,
    # then an AddBackward0): with that bias the store's too, nothing of the layer's graph is left for W.
    torch.manual_seed(0)
    stock = torch.nn.Sequential(torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True),
                                _RMSNorm(16)).to(dtype)
    stage = copy.deepcopy(stock)
    xs = [torch.randn(2, 5, 16, dtype=dtype) for _ in range(3)]
    gys = [torch.randn(2, 5, 16, dtype=dtype) for _ in range(3)]
    want_dx = _fused(stock, xs, gys)
    x = xs[0].clone().requires_grad_()
    params = list(stage.parameters())
    _, work = backward_input([stage(x)], [gys[0]], [x], params)
    in_b = {id(params[k]) for k in work.store.in_b}
    attn, norm = stage[0].self_attn, stage[1]
    assert {id(attn.in_proj_bias), id(norm.scale), id(norm.shift)} <= in_b and id(norm.twice) not in in_b
    assert len(work.store.linears) == 4  # the input and output projections, the two of the feed-forward
    (group,) = work.groups  # W enters the graph for the twice-added bias only
    assert [id(p) for p in group.params] == [id(norm.twice)]
    work.run()
    _split_equals_fused_bit_for_bit(stage, stock, xs, gys, want_dx)
    # The encoder layer alone: nothing left for W to enter, and after B only what W needs is held.
    encoder = stage[0]
    x = xs[0].clone().requires_grad_()
    with SavedBytes(encoder.parameters()) as meter:
        y = encoder(x)
        _, work = backward_input([y], [gys[0]], [x], list(encoder.parameters()))
        del y
        assert not work.groups and meter.live == tensor_bytes(work.store.inputs if work.store._kept is None
                                                              else work.store._kept.grad_fn.saved_tensors)
        work.run()


class _Squared(torch.nn.Module):
    """A parameter twice in one elementwise op (``p * p``), then applied: not one op's alone."""

    def __init__(self):
        super().__init__()
        self.p = torch.nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x):
        return torch.tanh(x) * (self.p * self.p)


def test_a_parameter_an_elementwise_op_takes_twice_goes_through_the_graph():
    stock = _Squared()
    stage = copy.deepcopy(stock)
    xs, gys = [torch.randn(4, 8) for _ in range(2)], [torch.randn(4, 8) for _ in range(2)]
    want_dx = _fused(stock, xs, gys)
    x = xs[0].clone().requires_grad_()
    _, work = backward_input([stage(x)], [gys[0]], [x], list(stage.parameters()))
    assert work.store is None and len(work.groups) == 1
    work.run()
    _split_equals_fused_bit_for_bit(stage, stock, xs, gys, want_dx)


class _Odd(torch.nn.Module):
    """Linears the store cannot take as they are: a weight stored transposed (not contiguous), a
    GEMM scaled by alpha, a Linear without bias on a 3-d input, and one under autocast (its weight
    reaches the GEMM through a cast)."""

    def __init__(self):
        super().__init__()
        self.t = torch.nn.Parameter(torch.randn(16, 12).t())  # (12, 16), column-major
        self.a, self.nb, self.c = torch.nn.Linear(12, 12), torch.nn.Linear(12, 12, bias=False), torch.nn.Linear(12, 12)

    def forward(self, x):
        h = torch.nn.functional.linear(x, self.t)
        h = torch.addmm(self.a.bias, h.reshape(-1, 12), self.a.weight.t(), alpha=2.0).view_as(h)
        h = self.nb(torch.tanh(h))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.c(h).float()


def test_linears_off_the_common_form_give_the_fused_gradients():
    stock = _Odd()
    stage = copy.deepcopy(stock)
    assert not stage.t.is_contiguous()
    xs, gys = [torch.randn(2, 5, 16) for _ in range(2)], [torch.randn(2, 5, 12) for _ in range(2)]
    want_dx = _fused(stock, xs, gys)
    x = xs[0].clone().requires_grad_()
    _, work = backward_input([stage(x)], [gys[0]], [x], list(stage.parameters()))
    # the transposed weight and the bias-free Linear are the store's; alpha and the cast are the graph's
    assert {id(work.store.params[lin.weight]) for lin in work.store.linears} == {id(stage.t), id(stage.nb.weight)}
    work.run()
    _split_equals_fused_bit_for_bit(stage, stock, xs, gys, want_dx)


class _Branchy(torch.nn.Module):
    """A forward whose graph changes with its input: a second Linear only for wide batches."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        return h + self.b(x).relu() if x.shape[0] > 2 else h


def test_graphs_of_other_shapes_get_their_own_analysis_and_the_same_shape_reuses_it():
    stock = _Branchy()
    stage = copy.deepcopy(stock)
    xs = [torch.randn(n, 8) for n in (4, 2, 4, 2, 3)]
    gys = [torch.randn(n, 8) for n in (4, 2, 4, 2, 3)]
    bw_split.forget_parameters()
    want_dx = _fused(stock, xs, gys)
    got_dx = _split(stage, xs, gys)
    assert len(bw_split._PLANS) == 2  # the batch size is no part of a graph's shape; the branch is
    for a, b in zip(got_dx, want_dx):
        torch.testing.assert_close(a, b)
    for p, q in zip(stage.parameters(), stock.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_a_weight_two_linears_share_is_summed_from_both_and_accumulated_once():
    class Tied(torch.nn.Module):  # a tied output head: the input layer's weight, used as a Linear's again
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x):
            return torch.nn.functional.linear(torch.tanh(self.lin(x)), self.lin.weight)

    stock = Tied()
    stage = copy.deepcopy(stock)
    fired = []
    stage.lin.weight.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.clone()))
    xs, gys = [torch.randn(3, 16) for _ in range(2)], [torch.randn(3, 16) for _ in range(2)]
    want_dx = _fused(stock, xs, gys)
    x = xs[0].clone().requires_grad_()
    _, work = backward_input([stage(x)], [gys[0]], [x], list(stage.parameters()))
    assert len(work.store.linears) == 2 and not work.groups
    work.run()
    assert len(fired) == 1
    _split_equals_fused_bit_for_bit(stage, stock, xs, gys, want_dx)  # the head's part first, as autograd adds them


def test_a_gemm_whose_scale_changes_between_graphs_of_one_shape_is_analysed_again():
    class Scaled(torch.nn.Module):  # one Linear's GEMM, scaled by 1 on some calls and by 2 on others
        def __init__(self):
            super().__init__()
            self.lin, self.alpha = torch.nn.Linear(8, 8), 1.0

        def forward(self, x):
            return torch.addmm(self.lin.bias, x, self.lin.weight.t(), alpha=self.alpha)

    stock = Scaled()
    stage = copy.deepcopy(stock)
    xs, gys = [torch.randn(4, 8) for _ in range(4)], [torch.randn(4, 8) for _ in range(4)]
    want, got = [], []
    for k, (x, gy) in enumerate(zip(xs, gys)):
        stock.alpha = stage.alpha = 2.0 if k % 2 else 1.0
        want.append(_fused(stock, [x], [gy])[0])
        x = x.clone().requires_grad_()
        (dx,), work = backward_input([stage(x)], [gy], [x], list(stage.parameters()))
        assert bool(work.store and work.store.linears) == (k % 2 == 0)  # a scaled GEMM is the graph's
        work.run()
        got.append(dx)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    for p, q in zip(stage.parameters(), stock.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("hooked", ["output", "parameters"])
def test_a_hook_on_a_linears_output_or_on_a_bias_or_norm_parameter_acts_once_as_in_a_fused_backward(hooked):
    def make(calls):
        torch.manual_seed(0)
        mod = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.LayerNorm(8), torch.nn.Linear(8, 8))
        mod.scale = torch.nn.Parameter(torch.rand(8) + 0.5)  # applied by one elementwise op
        if hooked == "parameters":  # B would compute these gradients: a hook must still run once
            mod[0].bias.register_hook(lambda g: calls.append("bias") or g * 2)
            mod[2].weight.register_hook(lambda g: calls.append("norm") or g * 2)
            mod.scale.register_hook(lambda g: calls.append("scale") or g * 3)
        return mod

    def forward(mod, x):
        h = mod[0](x)
        if hooked == "output":  # on the Linear's own output (2-d: the GEMM's output itself)
            h.register_hook(lambda g: g * 3)
        return mod[3](mod[2](mod[1](h)) * mod.scale)

    stock_calls, calls = [], []
    stock, stage = make(stock_calls), make(calls)
    params = list(stage.parameters())
    for _ in range(2):
        x, gy = torch.randn(4, 8), torch.randn(4, 8)
        xr, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
        torch.autograd.backward(forward(stock, xr), gy)
        (dx,), work = backward_input([forward(stage, xs)], [gy], [xs], params)
        assert len(work.store.linears) == (2 if hooked == "output" else 1)  # a hooked bias: its Linear is the graph's
        assert (id(stage.scale) in {id(params[k]) for k in work.store.in_b}) == (hooked == "output")
        work.run()
        torch.testing.assert_close(dx, xr.grad)
    assert calls == stock_calls  # each parameter hook once per micro-batch
    for (name, p), q in zip(stage.named_parameters(), stock.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_a_weight_three_linears_share_is_summed_as_autograd_sums_it():
    class Thrice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x):
            h = torch.tanh(self.lin(x))
            return torch.nn.functional.linear(h, self.lin.weight) + torch.nn.functional.linear(h * h, self.lin.weight)

    for seed in range(8):  # sums of three in another order differ in their last bits for most draws
        torch.manual_seed(seed)
        stock = Thrice()
        stage = copy.deepcopy(stock)
        xs, gys = [torch.randn(5, 16)], [torch.randn(5, 16)]
        want_dx = _fused(stock, xs, gys)
        _split_equals_fused_bit_for_bit(stage, stock, xs, gys, want_dx)


def test_w_holds_the_linears_inputs_without_their_graph_and_refuses_one_changed_in_place():
    stage = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    (dx,), work = backward_input([stage(x)], [torch.randn(4, 8)], [x], list(stage.parameters()))
    assert len(work.store.linears) == 2 and all(t.grad_fn is None for t in work.store.inputs)
    work.run()
    assert all(not p.grad.requires_grad for p in stage.parameters())  # W recorded no graph
    (dx,), work = backward_input([stage(x)], [torch.randn(4, 8)], [x], list(stage.parameters()))
    work.store.inputs[0].mul_(2)  # (the stage input itself, as the first Linear saved it)
    with pytest.raises(RuntimeError, match="modified in place between its B and its W"):
        work.run()


def test_a_non_leaf_parameter_is_left_to_the_graph():
    base = torch.randn(8, 8, requires_grad=True)
    w = base * 2  # a parameter computed from another tensor
    x = torch.randn(4, 8, requires_grad=True)
    (dx,), work = backward_input([torch.nn.functional.linear(x, w)], [torch.ones(4, 8)], [x], [w])
    assert work.store is None
    work.run()
    torch.testing.assert_close(w.grad, torch.ones(4, 8).t() @ x.detach())
    assert base.grad is None


def test_without_the_engines_entry_point_w_accumulates_through_torch_autograd_backward(monkeypatch):
    stock = _gpt_stage(torch.float32)
    stage = copy.deepcopy(stock)
    fired = []
    for p in stage.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    monkeypatch.setattr(wgrad_store, "_engine_run_backward", None)
    xs, gys = [torch.randn(2, 8, 32)], [torch.randn(2, 8, 32)]
    want_dx = _fused(stock, xs, gys)
    _split_equals_fused_bit_for_bit(stage, stock, xs, gys, want_dx)
    assert len(fired) == len(list(stage.parameters()))
