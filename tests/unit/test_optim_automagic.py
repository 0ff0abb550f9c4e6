# SPDX-License-Identifier: GPL-3.0-or-later
"""diffusion-pipe's ``automagic`` optimizer (backend/optim/automagic.py): per-element learning rates that grow
while an element's step keeps its sign and shrink when it flips, within [min_lr, max_lr]."""
import io

import pytest
import torch

from pipetrain.backend.optim.automagic import Automagic


def _step(opt, p, grad):
    p.grad = torch.as_tensor(grad, dtype=p.dtype).clone()
    opt.step()


def test_rates_grow_where_signs_agree_and_shrink_where_they_flip():
    p = torch.nn.Parameter(torch.zeros(4))
    opt = Automagic([p], lr=1e-4, lr_bump=1e-5, min_lr=1e-6, max_lr=1e-3)
    _step(opt, p, [1.0, 1.0, -1.0, 1.0])          # first step: no previous sign, rates stay at lr
    assert torch.allclose(opt.state[p]["lr_mask"], torch.full((4,), 1e-4))
    _step(opt, p, [1.0, -1.0, -1.0, -1.0])        # agree, flip, agree, flip
    assert torch.allclose(opt.state[p]["lr_mask"], torch.tensor([1.1e-4, 0.9e-4, 1.1e-4, 0.9e-4]))
    for _ in range(200):                          # bounded by max_lr / min_lr
        _step(opt, p, [1.0, 1.0, -1.0, 1.0]) if _ % 2 else _step(opt, p, [1.0, -1.0, -1.0, -1.0])
    mask = opt.state[p]["lr_mask"]
    assert mask[0] == pytest.approx(1e-3) and mask[2] == pytest.approx(1e-3)
    assert mask[1] == pytest.approx(1e-6) and mask[3] == pytest.approx(1e-6)
    assert opt.avg_lr() == pytest.approx(float(mask.mean()))


def test_step_is_the_clipped_normalised_gradient_times_the_rate():
    # a vector's second moment is per element: after one step with beta2 = 0, grad / sqrt(grad^2 + eps) = sign,
    # RMS 1 (clip_threshold 1: unscaled), so each element moves by exactly its rate
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    opt = Automagic([p], lr=1e-3, beta2=0.0, eps=(1e-30, 1e-3), weight_decay=0.1)
    _step(opt, p, [3.0, -0.5, 2.0])
    start = torch.tensor([1.0, 2.0, 3.0])
    want = start - start * 1e-3 * 0.1 - torch.tensor([1.0, -1.0, 1.0]) * 1e-3
    assert torch.allclose(p.detach(), want, atol=1e-7)


def test_a_toy_regression_loss_falls_and_rates_adapt():
    torch.manual_seed(0)
    x = torch.randn(256, 8)
    target = x @ torch.randn(8, 4)
    model = torch.nn.Linear(8, 4, bias=False)
    opt = Automagic(model.parameters(), lr=1e-3, lr_bump=1e-4, max_lr=3e-2)
    first = None
    for _ in range(300):
        loss = (model(x) - target).square().mean()
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05 * first
    assert opt.avg_lr() != pytest.approx(1e-3)       # the rates moved away from the start
    assert "exp_avg_sq_row" in opt.state[model.weight]   # a matrix keeps factored statistics


def test_bfloat16_weights_keep_updates_below_their_precision():
    p = torch.nn.Parameter(torch.ones(16, dtype=torch.bfloat16))
    opt = Automagic([p], lr=1e-4, lr_bump=0.0, beta2=0.0)
    for _ in range(100):                              # each step 1e-4, below bf16's 2^-8 spacing at 1.0
        _step(opt, p, torch.ones(16))
    moved = 1.0 - (p.float() + opt.state[p]["shift"].float())
    assert torch.allclose(moved, torch.full((16,), 1e-2), rtol=1e-2)
    assert p.float().max() < 1.0                      # and reached the weight itself


def test_state_survives_a_checkpoint_round_trip_at_its_dtype():
    torch.manual_seed(1)
    weights = [torch.nn.Parameter(torch.randn(3, 5, dtype=torch.bfloat16)), torch.nn.Parameter(torch.randn(5))]
    opt = Automagic(weights, lr=1e-4, lr_bump=1e-6)
    grads = [torch.randn(3, 5), torch.randn(5)]
    for sign in (1, -1, 1):
        for w, g in zip(weights, grads):
            w.grad = (sign * g).to(w.dtype)
        opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    copies = [torch.nn.Parameter(w.detach().clone()) for w in weights]
    again = Automagic(copies, lr=5e-5)
    again.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=False))
    for w, c in zip(weights, copies):
        a, b = opt.state[w], again.state[c]
        assert b["lr_mask"].dtype == torch.float32 and torch.equal(a["lr_mask"], b["lr_mask"])
        assert torch.equal(a["last_polarity"], b["last_polarity"]) and a["step"] == b["step"]
    for w, c, g in zip(weights, copies, grads):    # the next step is the same on both
        w.grad = g.to(w.dtype)
        c.grad = g.to(c.dtype)
    opt.step()
    again.step()
    for w, c in zip(weights, copies):
        assert torch.equal(w, c)
