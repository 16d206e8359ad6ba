"""B then W gives the gradients of one fused backward, for any module, without recomputation, with
and without the weight-gradient store for Linear and LayerNorm layers."""
from __future__ import annotations

import copy

import pytest
import torch

from ds_pipemorph.runtime.bw_split import backward_input


class LinearThenView(torch.nn.Module):  # stage ends in a view, plus a parameter off the input path
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.pos = torch.nn.Parameter(torch.randn(8))

    def forward(self, x):
        return (self.lin(x) + self.pos).view(-1)


class SameLinearTwice(torch.nn.Module):  # one weight reached from two frontier nodes
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


class FusedLinearFn(torch.autograd.Function):
    """Megatron-style: one Function whose backward returns the input and the weight gradient (and, in
    a tensor-parallel layer, all-reduces the input gradient in between); ``CALLS`` counts its runs."""

    CALLS = 0

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        FusedLinearFn.CALLS += 1
        return gy @ weight, (gy.reshape(-1, gy.shape[-1]).t() @ x.reshape(-1, x.shape[-1]))


class FusedLinear(torch.nn.Module):  # a custom Function on the input path, a weight reached through it
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(16, 8) / 4)
        self.out = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.out(torch.nn.functional.gelu(FusedLinearFn.apply(x, self.weight)))


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))


CASES = {
    "mlp": (_mlp, lambda: torch.randn(4, 8)),
    "embedding_first_stage": (lambda: torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8)),
                              lambda: torch.randint(0, 10, (4, 5))),
    "view_output": (LinearThenView, lambda: torch.randn(4, 8)),
    "shared_weight": (SameLinearTwice, lambda: torch.randn(4, 8)),
    "custom_function": (FusedLinear, lambda: torch.randn(4, 8)),
    "transformer_block": (lambda: torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True),
                          lambda: torch.randn(2, 5, 16)),
}


@pytest.mark.parametrize("store", [False, True], ids=["graph", "store"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_b_then_w_over_three_micro_batches_equals_fused_backward_with_accumulation(case, store):
    torch.manual_seed(0)
    make_module, make_input = CASES[case]
    mod = make_module()
    params = list(mod.parameters())
    stage = copy.deepcopy(mod)  # the reference is the stock module's fused backward
    stage_params = list(stage.parameters())
    xs = [make_input() for _ in range(3)]
    gys, ref_dx = [], []
    for x in xs:
        x = x.clone().requires_grad_(x.is_floating_point())
        y = mod(x)
        gy = torch.randn_like(y)
        gys.append(gy)
        y.backward(gy)
        ref_dx.append(x.grad)
    ref = [p.grad.clone() for p in params]
    works = []
    for x, gy, want in zip(xs, gys, ref_dx):
        x = x.clone().requires_grad_(x.is_floating_point())
        y = stage(x)
        (dx,), work = backward_input([y], [gy], [x], stage_params, store=store)
        if want is not None:
            torch.testing.assert_close(dx, want)
        works.append(work)
        del y, x  # the caller drops the activation after B
    assert all(p.grad is None for p in stage_params), "B must not touch parameter grads"
    for work in reversed(works):  # W in another order than B, as plans may do
        work.run()
    for p, r in zip(stage_params, ref):
        torch.testing.assert_close(p.grad, r, rtol=1e-5, atol=1e-6)


def test_w_of_a_linear_stack_reenters_each_linear_once_and_never_the_input_path():
    torch.manual_seed(0)
    mod = _mlp()
    x = torch.randn(4, 8, requires_grad=True)
    y = mod(x)
    _, work = backward_input([y], [torch.ones_like(y)], [x], list(mod.parameters()), store=False)
    assert len(work.groups) == 2  # one autograd call per Linear
    assert all(type(e.node).__name__ == "AddmmBackward0" for g in work.groups for e in g.edges)
    ran = []
    hooks = [e.node.register_hook(lambda gi, go: ran.append(gi)) for g in work.groups for e in g.edges]
    work.run()
    for h in hooks:
        h.remove()
    # W computes only the weight-side outputs of addmm: the input-side slot stays None.
    assert all(gi[1] is None for gi in ran)


class HookedActivations(torch.nn.Module):
    """Hooks on activations whose nodes W enters again: a Conv's output, and a Linear's output whose
    bias has a hook of its own (so the Linear is the graph's, not the store's)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.lin.bias.register_hook(lambda g: g * 0.5)
        self.conv = torch.nn.Conv1d(4, 4, 3, padding=1)

    def forward(self, x):  # x: (8, 8), so the Linear's output is its GEMM's own (no view over it)
        h = self.lin(x)
        h.register_hook(lambda g: g * 3)
        z = self.conv(torch.tanh(h).view(2, 4, 8))
        z.register_hook(lambda g: g * 2)
        return torch.tanh(z)


@pytest.mark.parametrize("store", [False, True], ids=["graph", "store"])
def test_hooks_on_activations_that_w_enters_again_shape_its_gradients_once(store):
    # A tensor's hooks run when the engine reaches the node that produced it: in B, and again when W
    # enters that node. W's gradients must be those of a backward in which each hook ran once.
    torch.manual_seed(0)
    ref = HookedActivations()
    stage = HookedActivations()
    stage.load_state_dict(ref.state_dict())
    xs, gys = [torch.randn(8, 8) for _ in range(2)], [torch.randn(2, 4, 8) for _ in range(2)]
    works = []
    for x, gy in zip(xs, gys):
        xr = x.clone().requires_grad_(True)
        ref(xr).backward(gy)
        x = x.clone().requires_grad_(True)
        (dx,), work = backward_input([stage(x)], [gy], [x], list(stage.parameters()), store=store)
        torch.testing.assert_close(dx, xr.grad)
        # the Conv's node and the Linear's GEMM, whose hooked outputs W enters again
        assert sorted(type(n).__name__ for n, _ in work.pinned) == ["AddmmBackward0", "ConvolutionBackward0"]
        works.append(work)
    for work in works:
        work.run()
    for (name, p), r in zip(stage.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_a_custom_function_on_the_input_path_runs_its_backward_once_in_b_and_never_in_w():
    # Its backward may communicate (a tensor-parallel all-reduce) or accumulate on its own: running it
    # again in W would repeat both. W starts below it, with the weight gradient it returned in B.
    torch.manual_seed(0)
    mod = FusedLinear()
    params = list(mod.parameters())
    xs, gys = [torch.randn(4, 8) for _ in range(3)], [torch.randn(4, 8) for _ in range(3)]
    ref = copy.deepcopy(mod)
    for x, gy in zip(xs, gys):
        ref(x.clone().requires_grad_(True)).backward(gy)
    works, calls = [], []
    FusedLinearFn.CALLS = 0
    for x, gy in zip(xs, gys):
        x = x.clone().requires_grad_(True)
        (dx,), work = backward_input([mod(x)], [gy], [x], params)
        calls.append(FusedLinearFn.CALLS)
        works.append(work)
    assert calls == [1, 2, 3]  # once per micro-batch, in B
    assert all(p.grad is None for p in params)
    for work in works:
        work.run()
    assert FusedLinearFn.CALLS == 3  # none in W
    for p, r in zip(params, ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-6)


def test_a_linear_whose_weight_another_output_reaches_too_is_entered_again_in_w():
    # A Linear's weight reached elsewhere too is not the store's: W enters its node again for the
    # weight and the bias, and B computes neither.
    torch.manual_seed(0)
    ref = torch.nn.Linear(8, 8)
    stage = copy.deepcopy(ref)
    x, gy, gz = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8)
    xr = x.clone().requires_grad_(True)
    torch.autograd.backward([ref(xr), ref.weight.sum(0)], [gy, gz])
    xs = x.clone().requires_grad_(True)
    (dx,), work = backward_input([stage(xs), stage.weight.sum(0)], [gy, gz], [xs], list(stage.parameters()))
    torch.testing.assert_close(dx, xr.grad)
    assert work.store is None and len(work.groups) == 1
    work.run()
    for p, r in zip(stage.parameters(), ref.parameters()):
        assert p.grad is not None
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-6)


def test_first_stage_with_integer_input_has_no_input_gradient_and_w_is_its_whole_backward():
    torch.manual_seed(0)
    mod = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8))
    tokens = torch.randint(0, 10, (4, 5))
    y = mod(tokens)
    (d,), work = backward_input([y], [torch.ones_like(y)], [tokens], list(mod.parameters()))
    assert d is None
    assert all(p.grad is None for p in mod.parameters())
    work.run()
    assert all(p.grad is not None for p in mod.parameters())


def test_b_and_w_as_one_pass_give_autograd_s_own_gradients_for_leaf_non_leaf_and_unused_inputs():
    """``backward_whole``: the stage-input gradients of one backward pass (None where an input needs
    none or is not reached) and every parameter's gradient, as ``torch.autograd.grad`` gives them."""
    from ds_pipemorph.runtime.bw_split import backward_whole

    torch.manual_seed(0)
    lin, norm = torch.nn.Linear(6, 6), torch.nn.LayerNorm(6)
    params = [*lin.parameters(), *norm.parameters()]

    def make():
        a = torch.randn(3, 6, requires_grad=True)
        base = torch.randn(3, 6, requires_grad=True)
        b = base * 2  # a non-leaf stage input
        unused = torch.randn(3, 6, requires_grad=True)
        ids = torch.randint(0, 6, (3,))
        out = norm(lin(a) + b.tanh()) * lin.weight[ids].sum()
        return [a, b, unused, ids], out

    torch.manual_seed(1)
    ins, out = make()
    g = torch.randn_like(out)
    want = torch.autograd.grad([out], [ins[0], ins[1], *params], grad_outputs=[g])
    torch.manual_seed(1)
    ins, out = make()
    for p in params:
        p.grad = None
    got = backward_whole([out, torch.zeros(2)], [g, None], ins)  # an output without a graph is skipped
    assert got[2] is None and got[3] is None  # not reached; needs no gradient
    for w, t in zip(want, [got[0], got[1], *(p.grad for p in params)]):
        assert torch.equal(w, t)
