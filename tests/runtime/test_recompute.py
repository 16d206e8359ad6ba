"""Split-aware activation checkpointing (``runtime.recompute``), in one process: each checkpointed
chunk's forward runs once in F and once more in B, never in W, and the gradients equal those of
the same stage without checkpointing (computed independently, by one fused ``torch.autograd.backward``)."""
from __future__ import annotations

import pytest
import torch

from ds_pipemorph.runtime.bw_split import backward_input
from ds_pipemorph.runtime.config import PipeMorphConfigError
from ds_pipemorph.runtime.recompute import Recompute, split_checkpoint


class Counted(torch.nn.Module):
    """Linear -> GELU -> Dropout -> Linear, counting its forward calls."""

    def __init__(self, d: int, p: float):
        super().__init__()
        self.a, self.b, self.drop = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d), torch.nn.Dropout(p)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x + self.b(self.drop(torch.nn.functional.gelu(self.a(x))))


def _stage(seed: int, p: float) -> torch.nn.ModuleList:
    torch.manual_seed(seed)
    return torch.nn.ModuleList([Counted(8, p), Counted(8, p), Counted(8, p)])


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_each_chunk_recomputes_once_in_b_and_w_reuses_it_with_gradients_of_the_plain_backward(dropout):
    ref, ckpt = _stage(0, dropout), _stage(0, dropout)
    x = torch.randn(4, 8)
    g = torch.randn(4, 8)

    torch.manual_seed(7)
    xr = x.clone().requires_grad_()
    out = xr
    for m in ref:
        out = m(out)
    torch.autograd.backward(out, g)

    torch.manual_seed(7)
    xc = x.clone().requires_grad_()
    out = xc
    for m in ckpt:
        out = split_checkpoint(m, out)
    assert [m.calls for m in ckpt] == [1, 1, 1]  # F
    params = list(ckpt.parameters())
    torch.manual_seed(123)  # B and W run later, with other random numbers drawn in between
    with Recompute(params) as chunks:
        (dx,), work = backward_input([out], [g], [xc], params)
    assert [m.calls for m in ckpt] == [2, 2, 2]  # B recomputed each chunk once
    assert [len(w.store.linears) for w in chunks.works] == [2, 2, 2]  # each chunk's two Linears: its store's
    assert all(p.grad is None for p in params)  # B left the weight gradients to W
    torch.testing.assert_close(dx, xr.grad, rtol=0, atol=1e-6)
    with Recompute(params) as more:
        for w in [work, *chunks.works]:
            w.run()
        more.drain()
    assert [m.calls for m in ckpt] == [2, 2, 2]  # W recomputed nothing
    for p, q in zip(ckpt.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6)


def test_a_chunk_whose_input_needs_no_gradient_is_refused_in_one_sentence():
    emb = torch.nn.Embedding(10, 4)
    with pytest.raises(PipeMorphConfigError, match="name only the transformer blocks in the PipelineModule's "
                                                   "checkpointable_layers$"):
        split_checkpoint(emb, torch.tensor([[1, 2, 3]]))


def test_a_checkpointed_chunk_differentiated_outside_b_or_w_says_so():
    m = Counted(8, 0.0)
    out = split_checkpoint(m, torch.randn(2, 8, requires_grad=True))
    with pytest.raises(RuntimeError, match="outside the engine's B or W"):
        out.sum().backward()


class TwoInputs(torch.nn.Module):
    """f(h, b) = h + Linear(h) * b: b comes from a parameter, h from the stage input."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.calls = 0

    def forward(self, h, b):
        self.calls += 1
        return h + self.lin(h) * b


def test_a_chunk_with_an_input_from_parameters_is_entered_again_by_w_without_recomputing():
    """The chunk's node is then a frontier node of the stage's graph: W enters it again for the
    parameter-side input's gradient, and gets B's, with no second recomputation or weight work."""
    torch.manual_seed(3)
    ref, ck = TwoInputs(), TwoInputs()
    ck.load_state_dict(ref.state_dict())
    scale_r, scale_c = (torch.nn.Parameter(torch.randn(8)) for _ in range(2))
    with torch.no_grad():
        scale_c.copy_(scale_r)
    x, g = torch.randn(4, 8), torch.randn(4, 8)

    xr = x.clone().requires_grad_()
    torch.autograd.backward(ref(xr, scale_r * 2), g)

    xc = x.clone().requires_grad_()
    out = split_checkpoint(ck, xc, scale_c * 2)
    params = [*ck.parameters(), scale_c]
    with Recompute(params) as chunks:
        (dx,), work = backward_input([out], [g], [xc], params)
    with Recompute(params) as more:
        for w in [work, *chunks.works]:
            w.run()
        more.drain()
    assert ck.calls == 2  # F, and once in B
    torch.testing.assert_close(dx, xr.grad, rtol=0, atol=1e-6)
    for p, q in ((ck.lin.weight, ref.lin.weight), (ck.lin.bias, ref.lin.bias), (scale_c, scale_r)):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6)

