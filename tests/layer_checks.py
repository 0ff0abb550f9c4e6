"""Checks shared by the per-architecture layer tests: pipeline layers against ComfyUI's own forward."""
from __future__ import annotations

import torch

from pipetrain.backend import lora


class Patcher:
    """Stands in for ComfyUI's ModelPatcher where a test builds the bare diffusion model."""

    def __init__(self, dm, model_sampling=None):
        self.model = type("M", (), {"diffusion_model": dm, "model_sampling": model_sampling})()


def comfy_model(arch: str, unet_config: dict, dtype=torch.float64, std: float = 0.05, seed: int = 0):
    """ComfyUI's own ``model_base`` model (diffusion model + model_sampling) for ``arch`` built from a config,
    weights drawn N(0, std) in ``dtype``, wrapped in a real ModelPatcher."""
    import comfy.model_management as mm
    import comfy.model_patcher

    from pipetrain.backend.models import loading

    model_config = loading._model_config(arch, unet_config)
    model_config.set_inference_dtype(dtype, None)
    model = model_config.get_model({}, "")
    torch.manual_seed(seed)
    for p in model.diffusion_model.parameters():
        torch.nn.init.normal_(p, std=std)
    for b in model.diffusion_model.buffers():
        if b.is_floating_point():
            torch.nn.init.normal_(b, std=std)
    return comfy.model_patcher.ModelPatcher(model, load_device=mm.get_torch_device(),
                                            offload_device=mm.unet_offload_device())


def run_layers(layers, inputs):
    h = inputs
    for layer in layers:
        h = layer(h)
    return h


def give_lora_b_values(dm, seed=2, std=0.05):
    """LoRA B starts at zero; give it values so every A receives a gradient too."""
    g = torch.Generator().manual_seed(seed)
    for m in lora.adapted_modules(dm):
        m.lora_B.weight.data.normal_(0, std, generator=g)


def lora_gradients_match_finite_differences(adapter, inputs, rtol=1e-5, atol=1e-9, eps=1e-6):
    """The LoRA gradient of the training layers' loss, projected on a random direction, equals the central
    finite difference of the loss through ComfyUI's own forward (``adapter.reference_forward``)."""
    dm = adapter.diffusion_model
    x0, noise, t, *text = inputs
    loss = adapter.loss(run_layers(adapter.to_layers(checkpoint_activations=True), inputs), (x0, noise, t))
    loss.backward()
    params = lora.trainable_parameters(dm)
    missing = [p.shape for p in params if p.grad is None or p.grad.abs().sum() == 0]
    assert not missing, f"{len(missing)} LoRA tensors got no gradient"
    g = torch.Generator().manual_seed(3)
    directions = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]
    analytic = sum((p.grad * d).sum() for p, d in zip(params, directions))

    def comfy_loss():
        with torch.no_grad():
            pred = adapter.reference_forward(adapter.objective().noisy(x0, noise, t), t, text)
            return adapter.loss(pred, (x0, noise, t))

    with torch.no_grad():
        for p, d in zip(params, directions):
            p.add_(eps * d)
        plus = comfy_loss()
        for p, d in zip(params, directions):
            p.sub_(2 * eps * d)
        minus = comfy_loss()
        for p, d in zip(params, directions):
            p.add_(eps * d)
    for p in params:
        p.grad = None
    numeric = (plus - minus) / (2 * eps)
    assert torch.allclose(analytic, numeric, rtol=rtol, atol=atol), (analytic.item(), numeric.item())


def every_boundary_is_a_stage_boundary(adapter, inputs):
    """Cut after every layer the way DeepSpeed's pipeline does (received activations are fresh leaves; a
    stage's backward starts from its float outputs with the next stage's input gradients): every float
    output has a graph, every float input gets a gradient, and the LoRA gradients equal an uncut run."""
    dm = adapter.diffusion_model
    params = lora.trainable_parameters(dm)
    x0, noise, t, *_ = inputs
    layers = adapter.to_layers(checkpoint_activations=True)
    adapter.loss(run_layers(layers, inputs), (x0, noise, t)).backward()
    uncut = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None

    stages, h = [], tuple(x.clone().requires_grad_(x.is_floating_point()) for x in inputs)
    for layer in layers[:-1]:
        out = layer(h)
        assert all(x.requires_grad for x in out if x.is_floating_point()), type(layer).__name__
        stages.append((h, out))
        h = tuple(x.detach().requires_grad_(x.is_floating_point()) for x in out)
    adapter.loss(layers[-1](h), (x0, noise, t)).backward()
    received = h
    for i, (h_in, out) in enumerate(reversed(stages)):
        grads = [x.grad for x in received if x.is_floating_point()]
        assert all(g is not None for g in grads), f"layer {len(stages) - i}: an input got no gradient"
        torch.autograd.backward([x for x in out if x.is_floating_point()], grads)
        received = h_in
    for p, u in zip(params, uncut):
        assert torch.allclose(p.grad, u, rtol=1e-10, atol=1e-14)
        p.grad = None
