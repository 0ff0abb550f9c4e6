"""Flux pipeline layers against ComfyUI's own forward: same outputs, and gradients that agree with
finite differences of ComfyUI's forward (which itself cannot run backward: in-place residuals)."""
import pytest
import torch

from pipetrain.backend import lora
from pipetrain.backend.config import ModelConfig
from pipetrain.backend.runtime import ensure_comfyui


class _Patcher:
    def __init__(self, dm):
        self.model = type("M", (), {"diffusion_model": dm})()


@pytest.fixture(scope="module")
def small_flux():
    ensure_comfyui()
    import comfy.ops
    from comfy.ldm.flux.model import Flux
    from pipetrain.backend.models.flux import FluxAdapter

    torch.manual_seed(0)
    dm = Flux(operations=comfy.ops.disable_weight_init, in_channels=16, out_channels=16, vec_in_dim=32,
              context_in_dim=48, hidden_size=64, mlp_ratio=4.0, num_heads=4, depth=2, depth_single_blocks=2,
              axes_dim=[4, 6, 6], theta=10000, patch_size=2, qkv_bias=True, guidance_embed=True)
    dm = dm.double()
    for p in dm.parameters():
        torch.nn.init.normal_(p, std=0.08)
    adapter = FluxAdapter(ModelConfig(type="flux", diffusion_model="unused", vae="unused", guidance=3.5))
    adapter.dtype = torch.float64
    adapter.patcher = _Patcher(dm)
    return adapter


def _inputs():
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(2, 16, 6, 10, generator=g, dtype=torch.float64)
    return (x0, torch.randn(x0.shape, generator=g, dtype=torch.float64), torch.tensor([0.25, 0.8], dtype=torch.float64),
            torch.randn(2, 5, 48, generator=g, dtype=torch.float64), torch.randn(2, 32, generator=g, dtype=torch.float64))


def _run_layers(layers, inputs):
    h = inputs
    for layer in layers:
        h = layer(h)
    return h


def test_layers_match_comfyui_forward(small_flux):
    a = small_flux
    x0, noise, t, ctx, pooled = inputs = _inputs()
    with torch.no_grad():
        ours = _run_layers(a.to_layers(), inputs)
        ref = a.reference_forward(a.objective().noisy(x0, noise, t), t, [ctx, pooled])
    assert ours.shape == x0.shape
    assert torch.allclose(ours, ref, atol=1e-10, rtol=1e-8)


def test_lora_gradients_match_finite_differences_of_comfyui_forward(small_flux):
    a = small_flux
    dm = a.diffusion_model
    names = lora.inject(dm, lora.LoRASpec(rank=4, alpha=4.0, dtype=torch.float64), a.lora_block_prefixes)
    assert "double_blocks.0.img_attn.qkv" in names and "single_blocks.1.linear2" in names
    modules = list(lora.adapted_modules(dm))
    g = torch.Generator().manual_seed(2)
    for m in modules:  # B starts at zero; give it values so every A receives a gradient too
        m.lora_B.weight.data.normal_(0, 0.05, generator=g)
    x0, noise, t, ctx, pooled = inputs = _inputs()
    loss = a.loss(_run_layers(a.to_layers(checkpoint_activations=True), inputs), (x0, noise, t))
    loss.backward()
    params = lora.trainable_parameters(dm)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)

    directions = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]
    analytic = sum((p.grad * d).sum() for p, d in zip(params, directions))

    def comfy_loss():
        with torch.no_grad():
            pred = a.reference_forward(a.objective().noisy(x0, noise, t), t, [ctx, pooled])
            return a.loss(pred, (x0, noise, t))

    eps = 1e-6
    with torch.no_grad():
        for p, d in zip(params, directions):
            p.add_(eps * d)
        plus = comfy_loss()
        for p, d in zip(params, directions):
            p.sub_(2 * eps * d)
        minus = comfy_loss()
        for p, d in zip(params, directions):
            p.add_(eps * d)
    numeric = (plus - minus) / (2 * eps)
    assert torch.allclose(analytic, numeric, rtol=1e-5, atol=1e-9), (analytic, numeric)


def test_comfyui_block_forward_really_breaks_autograd(small_flux):
    """The reason the layers exist: ComfyUI's inference forward cannot be trained through."""
    a = small_flux
    x0, noise, t, ctx, pooled = _inputs()
    x = a.objective().noisy(x0, noise, t).requires_grad_(True)
    with pytest.raises(RuntimeError, match="inplace"):
        a.reference_forward(x, t, [ctx, pooled]).sum().backward()
