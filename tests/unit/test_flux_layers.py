"""Flux pipeline layers against ComfyUI's own forward: same outputs, and gradients that agree with
finite differences of ComfyUI's forward (which itself cannot run backward: in-place residuals)."""
import pytest
import torch
from layer_checks import (every_boundary_is_a_stage_boundary, give_lora_b_values,
                          lora_gradients_match_finite_differences, run_layers, small_flux_adapter)

from pipetrain.backend.adapters import injection


@pytest.fixture
def small_flux():
    return small_flux_adapter()


def _inputs():
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(2, 16, 6, 10, generator=g, dtype=torch.float64)
    return (x0, torch.randn(x0.shape, generator=g, dtype=torch.float64), torch.tensor([0.25, 0.8], dtype=torch.float64),
            torch.randn(2, 5, 48, generator=g, dtype=torch.float64), torch.randn(2, 32, generator=g, dtype=torch.float64))


def test_layers_match_comfyui_forward(small_flux):
    a = small_flux
    x0, noise, t, ctx, pooled = inputs = _inputs()
    with torch.no_grad():
        ours = run_layers(a.to_layers(), inputs)
        ref = a.reference_forward(a.objective().noisy(x0, noise, t), t, [ctx, pooled])
    assert ours.shape == x0.shape
    assert torch.allclose(ours, ref, atol=1e-10, rtol=1e-8)


def _with_lora(adapter):
    names = injection.inject(adapter.diffusion_model, injection.AdapterSpec(rank=4, alpha=4.0, dtype=torch.float64),
                        adapter.lora_block_prefixes)
    give_lora_b_values(adapter.diffusion_model)
    return names


def test_lora_gradients_match_finite_differences_of_comfyui_forward(small_flux):
    names = _with_lora(small_flux)
    assert "double_blocks.0.img_attn.qkv" in names and "single_blocks.1.linear2" in names
    # ComfyUI's rotary tables are float32 whatever the model dtype: a larger step keeps their rounding small
    lora_gradients_match_finite_differences(small_flux, _inputs(), eps=1e-4)


def test_every_layer_boundary_can_be_a_stage_boundary(small_flux):
    _with_lora(small_flux)
    every_boundary_is_a_stage_boundary(small_flux, _inputs())


def test_comfyui_block_forward_really_breaks_autograd(small_flux):
    """The reason the layers exist: ComfyUI's inference forward cannot be trained through."""
    a = small_flux
    x0, noise, t, ctx, pooled = _inputs()
    x = a.objective().noisy(x0, noise, t).requires_grad_(True)
    with pytest.raises(RuntimeError, match="inplace"):
        a.reference_forward(x, t, [ctx, pooled]).sum().backward()
