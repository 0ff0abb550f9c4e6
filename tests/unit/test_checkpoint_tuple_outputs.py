# SPDX-License-Identifier: GPL-3.0-or-later
"""A checkpointed block with several outputs, backpropagated one output at a time with retain_graph (what
DeepSpeed's pipeline engine does with a stage's tuple outputs, e.g. under partition_method = 'parameters'): every
mode gives the gradients of the block without checkpointing."""
import pytest
import torch

from pipetrain.backend.models.checkpointing import SELECTIVE, UNSLOTH, run_checkpointed


@pytest.mark.parametrize("mode", [True, UNSLOTH, SELECTIVE])
def test_each_output_backpropagated_on_its_own_gives_the_unchecked_gradients(mode):
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)

    def block(h):
        y = torch.tanh(lin(h))
        return y, y * h

    wa, wb = torch.randn(4, 8), torch.randn(4, 8)
    grads = []
    for m in (False, mode):
        lin.zero_grad()
        x.grad = None
        a, b = run_checkpointed(m, block, x)
        torch.autograd.backward(a, wa, retain_graph=True)
        torch.autograd.backward(b, wb)
        grads.append([lin.weight.grad.clone(), lin.bias.grad.clone(), x.grad.clone()])
    for plain, checked in zip(*grads):
        assert torch.allclose(plain, checked, atol=1e-6), (plain - checked).abs().max()
