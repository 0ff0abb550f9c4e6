"""Memory savers on the micro Flux, in process: ``activation_checkpointing = 'unsloth'`` (block inputs parked in
CPU memory, block recomputed in backward) gives the loss and LoRA gradients of ``true`` and of no
checkpointing, LoRA dropout included (the recompute replays the RNG)."""
from __future__ import annotations

import pytest
import torch
from conftest import micro_flux_with_lora

from pipetrain.backend import lora


@pytest.fixture(scope="module")
def flux(micro_flux_files):
    return micro_flux_with_lora(micro_flux_files)


def _step(adapter, inputs, mode):
    x0, noise, t, text = inputs
    layers = adapter.to_layers(mode)
    torch.manual_seed(11)   # LoRA dropout masks
    h = (x0, noise, t, *text)
    grad_fns = set()
    for layer in layers:
        h = layer(h)
        grad_fns |= {type(x.grad_fn).__name__ for x in (h if isinstance(h, tuple) else (h,)) if x.grad_fn}
    loss = adapter.loss(h, (x0, noise, t))
    params = lora.trainable_parameters(adapter.diffusion_model)
    for p in params:
        p.grad = None
    loss.backward()   # as DeepSpeed does (the offloaded recompute accumulates into .grad, like reentrant checkpoints)
    return float(loss.detach()), torch.cat([p.grad.flatten() for p in params]), grad_fns


def test_unsloth_checkpointing_matches_true_and_no_checkpointing(flux):
    adapter, inputs = flux
    loss_off, grads_off, _ = _step(adapter, inputs, False)
    loss_true, grads_true, _ = _step(adapter, inputs, True)
    loss_u, grads_u, fns = _step(adapter, inputs, "unsloth")
    assert "_OffloadedCheckpointBackward" in fns        # the offloading path ran, not plain checkpointing
    assert grads_u.abs().sum() > 0
    assert loss_u == pytest.approx(loss_true, rel=1e-6) and loss_true == pytest.approx(loss_off, rel=1e-6)
    torch.testing.assert_close(grads_u, grads_true, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grads_u, grads_off, rtol=1e-5, atol=1e-7)


def test_unsloth_is_accepted_in_the_config_and_wrong_values_named():
    from pipetrain.backend.config import RunConfig
    from pipetrain.backend.errors import ConfigError
    from pipetrain.backend.schema import from_dict

    base = {"output_dir": "o", "dataset": "d.toml", "model": {"type": "flux", "diffusion_model": "m", "vae": "v"}}
    assert from_dict(RunConfig, {**base, "activation_checkpointing": "unsloth"}).activation_checkpointing == "unsloth"
    assert from_dict(RunConfig, {**base, "activation_checkpointing": True}).activation_checkpointing is True
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        from_dict(RunConfig, {**base, "activation_checkpointing": "offload"})
