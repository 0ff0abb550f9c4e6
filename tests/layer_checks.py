"""Checks shared by the per-architecture layer tests: pipeline layers against ComfyUI's own forward."""
from __future__ import annotations

from contextlib import contextmanager

import torch

from pipetrain.backend.adapters import injection
from pipetrain.backend.models.checkpointing import apply_checkpointing
from pipetrain.backend.train.pipeline import sendable


def small_flux_adapter(depth: int = 2, single_blocks: int = 2):
    """A narrow Flux (float64, random weights) behind a FluxAdapter, built in memory."""
    from pipetrain.backend.config import ModelConfig
    from pipetrain.backend.host.runtime import ensure_comfyui

    ensure_comfyui()
    import comfy.ops
    from comfy.ldm.flux.model import Flux

    from pipetrain.backend.models.flux import FluxAdapter

    torch.manual_seed(0)
    dm = Flux(operations=comfy.ops.disable_weight_init, in_channels=16, out_channels=16, vec_in_dim=32,
              context_in_dim=48, hidden_size=64, mlp_ratio=4.0, num_heads=4, depth=depth,
              depth_single_blocks=single_blocks, axes_dim=[4, 6, 6], theta=10000, patch_size=2, qkv_bias=True,
              guidance_embed=True)
    dm = dm.double()
    for p in dm.parameters():
        torch.nn.init.normal_(p, std=0.08)
    adapter = FluxAdapter(ModelConfig(type="flux", diffusion_model="unused", vae="unused", guidance=3.5))
    adapter.dtype = torch.float64
    adapter.use_model(Patcher(dm))
    return adapter


def checkpointed_layers(adapter, mode, fraction: float = 1.0):
    """The adapter's layers under activation checkpointing ``mode``, applied as the engine applies it."""
    layers = adapter.to_layers()
    apply_checkpointing(layers, mode, fraction)
    return layers


class Patcher:
    """Stands in for ComfyUI's ModelPatcher where a test builds the bare diffusion model."""

    def __init__(self, dm, model_sampling=None):
        self.model = type("M", (), {"diffusion_model": dm, "model_sampling": model_sampling})()


@contextmanager
def saved_bytes(skip: tuple[torch.Tensor, ...] = ()):
    """Counts the bytes autograd keeps for the backward of what runs inside (compiled graphs' saved tensors
    included); yields a list that holds each saved tensor's size. Tensors sharing storage with ``skip`` (weights:
    keeping one costs no memory) are not counted."""
    skipped = {t.untyped_storage().data_ptr() for t in skip}
    sizes: list[int] = []

    def pack(x):
        if x.untyped_storage().data_ptr() not in skipped:
            sizes.append(x.numel() * x.element_size())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        yield sizes


def padded_caption_inputs(channels: int, size: tuple, tokens: tuple, width: int, batch: int = 2, seed: int = 1):
    """float64 probe inputs (x0, noise, t, captions, caption lengths) and the generator that drew them, for drawing
    more: latents [B, channels, *size], captions [B, max(tokens), width] zero past each caption's length."""
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(batch, channels, *size, generator=g, dtype=torch.float64)
    noise = torch.randn(x0.shape, generator=g, dtype=torch.float64)
    t = torch.tensor([0.25, 0.8, 0.05, 0.97][:batch], dtype=torch.float64)
    cond = torch.randn(batch, max(tokens), width, generator=g, dtype=torch.float64)
    for i, n in enumerate(tokens):
        cond[i, n:] = 0
    return (x0, noise, t, cond, torch.tensor(tokens)), g


def comfy_model(arch: str, unet_config: dict, dtype=torch.float64, std: float = 0.05, seed: int = 0):
    """ComfyUI's own ``model_base`` model (diffusion model + model_sampling) for ``arch`` built from a config,
    weights drawn N(0, std) in ``dtype``, wrapped in a real ModelPatcher."""
    from pipetrain.backend.models.loading import build_model

    patcher = build_model(arch, unet_config, dtype)
    torch.manual_seed(seed)
    for p in patcher.model.diffusion_model.parameters():
        torch.nn.init.normal_(p, std=std)
    for b in patcher.model.diffusion_model.buffers():
        if b.is_floating_point():
            torch.nn.init.normal_(b, std=std)
    return patcher


def run_layers(layers, inputs):
    h = inputs
    for layer in layers:
        h = layer(h)
    return h


def give_lora_b_values(dm, seed=2, std=0.05):
    """LoRA B starts at zero; give it values so every A receives a gradient too."""
    g = torch.Generator().manual_seed(seed)
    for m in injection.adapted_modules(dm):
        m.lora_B.weight.data.normal_(0, std, generator=g)


def lora_gradients_match_finite_differences(adapter, inputs, rtol=1e-5, atol=1e-9, eps=1e-6):
    """The LoRA gradient of the training layers' loss, projected on a random direction, equals the central
    finite difference of the loss through ComfyUI's own forward (``adapter.reference_forward``); selective
    checkpointing (kept attention and down-projection outputs) gives the gradients of whole-block checkpointing."""
    dm = adapter.diffusion_model
    x0, noise, t, *text = inputs
    params = injection.trainable_parameters(dm)
    adapter.loss(run_layers(checkpointed_layers(adapter, "selective"), inputs), (x0, noise, t)).backward()
    selective = [p.grad.clone() if p.grad is not None else None for p in params]
    for p in params:
        p.grad = None
    loss = adapter.loss(run_layers(checkpointed_layers(adapter, True), inputs), (x0, noise, t))
    loss.backward()
    for p, g in zip(params, selective):
        if p.grad is not None:
            torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-9)
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


def over_the_wire(t: torch.Tensor) -> torch.Tensor:
    """What the next stage receives: DeepSpeed allocates a row-major buffer of the sent shape and
    torch.distributed fills it with the sent tensor's bytes in the order they lie in memory."""
    dims = sorted(range(t.ndim), key=lambda d: -t.stride(d))
    return t.detach().permute(dims).contiguous().view(-1).view(t.shape).clone()


def every_boundary_is_a_stage_boundary(adapter, inputs):
    """Cut after every layer the way DeepSpeed's pipeline does (outputs leave through ``StagedModule``'s
    ``sendable`` and arrive as ``over_the_wire`` gives them; received activations are fresh leaves; a
    stage's backward starts from its float outputs with the next stage's input gradients): every float
    output has a graph, every float input gets a gradient, and the LoRA gradients equal an uncut run."""
    dm = adapter.diffusion_model
    params = injection.trainable_parameters(dm)
    x0, noise, t, *_ = inputs
    layers = checkpointed_layers(adapter, True)
    adapter.loss(run_layers(layers, inputs), (x0, noise, t)).backward()
    uncut = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None

    stages, h = [], tuple(x.clone().requires_grad_(x.is_floating_point()) for x in inputs)
    for layer in layers[:-1]:
        out = tuple(map(sendable, layer(h)))
        assert all(x.requires_grad for x in out if x.is_floating_point()), type(layer).__name__
        stages.append((h, out))
        h = tuple(over_the_wire(x).requires_grad_(x.is_floating_point()) for x in out)
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


def small_adapter(adapter_class, arch: str, unet_config: dict, std: float = 0.05, model_type: str | None = None):
    """``adapter_class`` in float64 over ComfyUI's own ``model_base`` model built from ``unet_config``."""
    from pipetrain.backend.config import ModelConfig

    adapter = adapter_class(ModelConfig(type=model_type or arch, diffusion_model="unused", vae="unused"))
    adapter.dtype = torch.float64
    adapter.use_model(comfy_model(arch, unet_config, std=std))
    return adapter


def meta_state_dict(module) -> dict:
    """A file's tensors as ComfyUI's detection sees them (shapes only, on the meta device)."""
    from pipetrain.backend.models import tiny

    return {k: torch.empty(s, device="meta") for k, s, _ in tiny.tensor_plan(module)}


def layout_state_dict(arch: str, size: str) -> dict:
    from pipetrain.backend.models import tiny

    return meta_state_dict(tiny.build_diffusion_model(arch, size))


def comfyui_detects(sd: dict, arch: str, comfy_class: str, unet_config: dict):
    """ComfyUI's detection takes ``sd`` for ``comfy.supported_models.<comfy_class>`` with ``unet_config``, and
    PipeTrain's for ``arch``."""
    import comfy.model_detection
    import comfy.supported_models

    from pipetrain.backend.models import loading

    assert type(comfy.model_detection.model_config_from_unet(sd, "")) is getattr(comfy.supported_models, comfy_class)
    assert comfy.model_detection.detect_unet_config(sd, "") == unet_config
    assert loading.arch_from_state_dict_shapes({k: v.shape for k, v in sd.items()}) == arch


def layers_match_comfyui_forward(adapter, inputs, layer_names: list[str] | None = None, atol=1e-10, rtol=1e-8):
    """The layers (named ``layer_names``, in order, where given) compute ComfyUI's own forward
    (``adapter.reference_forward``); returns their output."""
    x0, noise, t, *text = inputs
    layers = adapter.to_layers()
    if layer_names is not None:
        assert [type(x).__name__ for x in layers] == layer_names
    with torch.no_grad():
        ours = run_layers(layers, inputs)
        ref = adapter.reference_forward(adapter.objective().noisy(x0, noise, t), t, text)
    assert ours.shape == x0.shape
    assert torch.allclose(ours, ref, atol=atol, rtol=rtol), (ours - ref).abs().max()
    return ours


def flow_targets_agree_with_comfyui(adapter, inputs, tolerance=1e-6, **comfy_conds):
    """ComfyUI's flow sampling noises as the objective does, turns its target back into the clean latent and
    gives the network the same timestep; its ``apply_model`` (with ``comfy_conds``) denoises as the layers do,
    to ``tolerance`` relative to the largest value."""
    model, objective = adapter.patcher.model, adapter.objective()
    ms = model.model_sampling
    x0, noise, t, *_ = inputs
    x_comfy = ms.noise_scaling(t, noise, x0)
    assert torch.allclose(ms.calculate_input(t, x_comfy), objective.noisy(x0, noise, t))
    assert torch.allclose(ms.calculate_denoised(t, objective.target(x0, noise, t), x_comfy), x0)
    assert torch.equal(ms.timestep(t), objective.model_timestep(t))
    with torch.no_grad():
        comfy_denoised = model.apply_model(x_comfy, t, **comfy_conds)
        ours = ms.calculate_denoised(t, run_layers(adapter.to_layers(), inputs), x_comfy)
    assert (comfy_denoised - ours).abs().max() / ours.abs().max() < tolerance


def discrete_targets_agree_with_comfyui(adapter, prediction: str, inputs, **comfy_conds):
    """UNet models on ComfyUI's ``ModelSamplingDiscrete`` with ``prediction`` (eps or v) as ComfyUI samples it: what
    the UNet sees in training is what ComfyUI's ``apply_model`` feeds it for the same noisy latent, and a perfect
    prediction of the training target is denoised by ComfyUI to the clean latent. ``comfy_conds``: the conditioning
    ComfyUI's sampler encodes for the model (``cross_attn``, ``pooled_output``)."""
    import comfy.model_base

    model = adapter.patcher.model
    sampling = model.model_sampling
    kind = comfy.model_base.ModelType.V_PREDICTION if prediction == "v" else comfy.model_base.ModelType.EPS
    model.model_sampling = comfy.model_base.model_sampling(model.model_config, kind)
    try:
        _discrete_targets_agree(adapter, prediction, inputs, comfy_conds)
    finally:
        model.model_sampling = sampling


def _discrete_targets_agree(adapter, prediction, inputs, comfy_conds):
    import comfy.samplers

    from pipetrain.backend.models.objectives import DiscreteDiffusion

    model = adapter.patcher.model
    ms = model.model_sampling
    objective = adapter.objective()
    assert isinstance(objective, DiscreteDiffusion) and objective.prediction == prediction
    x0, noise, t, *_ = inputs
    sigma = ms.sigma(t)
    assert torch.equal(ms.timestep(sigma).float(), t)
    x_comfy = ms.noise_scaling(sigma, noise, x0)           # ComfyUI's noisy latent: x0 + sigma * noise
    assert torch.allclose(ms.calculate_input(sigma, x_comfy), objective.noisy(x0, noise, t), rtol=1e-6, atol=1e-6)
    denoised = ms.calculate_denoised(sigma, objective.target(x0, noise, t), x_comfy)
    assert torch.allclose(denoised, x0, rtol=1e-5, atol=1e-5)
    # the whole path: ComfyUI's sampler conditioning (SDXL's y from its own size defaults) and apply_model
    conds = comfy.samplers.encode_model_conds(model.extra_conds, [{**comfy_conds, "model_conds": {}}], x_comfy,
                                              torch.device("cpu"), "positive")
    kwargs = {k: v.cond for k, v in conds[0]["model_conds"].items()}
    with torch.no_grad():
        comfy_denoised = model.apply_model(x_comfy, sigma, **kwargs)
        ours = ms.calculate_denoised(sigma, run_layers(adapter.to_layers(), inputs), x_comfy)
    err = (comfy_denoised - ours).abs().max() / ours.abs().max()
    assert err < 1e-6, err  # apply_model returns the model output in float32


def captions_batch_as_if_alone(adapter, x0, noise, t, items, atol=1e-10, rtol=1e-8) -> list[torch.Tensor]:
    """Cached captions of different lengths (``items``, one per sample) collated into one micro-batch give each
    sample the output it gets alone; returns the collated text."""
    collated = adapter.collate_text(items)
    with torch.no_grad():
        layers = adapter.to_layers()
        batched = run_layers(layers, (x0, noise, t, *collated))
        for i, item in enumerate(items):
            alone = run_layers(layers, (x0[i:i + 1], noise[i:i + 1], t[i:i + 1], *adapter.collate_text([item])))
            assert torch.allclose(batched[i:i + 1], alone, atol=atol, rtol=rtol)
    return collated


def every_boundary_is_a_stage_boundary_with_lora(adapter, inputs):
    """``every_boundary_is_a_stage_boundary`` with LoRA injected (rank 2, B given values) unless it already is."""
    dm = adapter.diffusion_model
    if not list(injection.adapted_modules(dm)):
        injection.inject(dm, injection.AdapterSpec(rank=2, alpha=2.0, dtype=torch.float64), adapter.lora_block_prefixes)
        give_lora_b_values(dm)
    every_boundary_is_a_stage_boundary(adapter, inputs)


def is_down_projection(op: str, shapes) -> bool:
    """A matrix product (``aten::mm`` / ``aten::addmm`` and its operand shapes) whose inner dimension is at least 4x
    its output width: what selective checkpointing keeps (the MLP down-projections)."""
    factors = {"aten::mm": shapes[:2], "aten::addmm": shapes[1:3]}.get(op)
    return bool(factors) and len(factors[0]) == 2 and factors[0][-1] >= 4 * factors[1][-1]
