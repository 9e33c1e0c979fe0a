"""Training loops the compiled front-end's tests compare: plain ``torch.compile`` against
tierflow's, the same seeded model and batches, on ``aot_eager``."""

from __future__ import annotations

import torch
from torch import nn

import tierflow.compiled as tc


def fit(model: nn.Module, fn, inputs, loss=lambda y: y, lr: float = 1e-2):
    """Losses and final parameters of AdamW steps of ``model`` called through ``fn``, one
    step an input."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for x in inputs:
        out = loss(fn(x))
        out.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.item())
    return losses, [q.detach().clone() for q in model.parameters()]


def fit_compiled(make_model, inputs, budget, *, loss=None, lr: float = 1e-3):
    """Losses, final parameters and the handle (None for plain) of AdamW steps of a model
    seeded with 0: plain ``torch.compile`` when ``budget`` is None, else tierflow's with no
    headroom and no recompute. ``loss(output, input)`` makes the loss (default: the output)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = make_model()
    run = None
    if budget is None:
        fn = torch.compile(model, backend="aot_eager")
    else:
        run = tc.compile(model, budget=budget, backend="aot_eager", headroom=0.0, recompute=False)
        fn = run.model
    step = fn if loss is None else (lambda x: loss(fn(x), x))
    return *fit(model, step, inputs, lr=lr), run
