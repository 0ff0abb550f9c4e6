"""Flux Kontext pipeline layers against ComfyUI's Flux forward with reference latents (``ref_latents``): the same
output, LoRA gradients equal to finite differences of that forward, training targets ComfyUI's flow sampling
turns back into the clean latent, the cached reference equal to what ComfyUI's ReferenceLatent conditioning
gives the network, and tuples DeepSpeed's pipeline can cut anywhere."""
import pytest
import torch
from layer_checks import (comfy_model, every_boundary_is_a_stage_boundary_with_lora, give_lora_b_values,
                          layers_match_comfyui_forward, lora_gradients_match_finite_differences, run_layers)

from pipetrain.backend.adapters import injection
from pipetrain.backend.config import ModelConfig
from pipetrain.backend.errors import ModelError
from pipetrain.backend.host.runtime import ensure_comfyui

ensure_comfyui()


@pytest.fixture(scope="module")
def small_kontext():
    """ComfyUI's own ``model_base.Flux`` in float64: width 64 (4 heads of 16), 2 double + 2 single blocks."""
    from pipetrain.backend.models.flux_kontext import FluxKontextAdapter

    config = {"image_model": "flux", "in_channels": 16, "out_channels": 16, "vec_in_dim": 32, "context_in_dim": 48,
              "hidden_size": 64, "mlp_ratio": 4.0, "num_heads": 4, "depth": 2, "depth_single_blocks": 2,
              "axes_dim": [4, 6, 6], "theta": 10000, "patch_size": 2, "qkv_bias": True, "guidance_embed": True}
    adapter = FluxKontextAdapter(ModelConfig(type="flux_kontext", diffusion_model="unused", vae="unused",
                                             guidance=2.5))
    adapter.dtype = torch.float64
    adapter.use_model(comfy_model("flux_kontext", config, std=0.08))
    return adapter


def _inputs(size=(6, 10), reference_size=None, seed=1):
    """x0, noise, t, T5 tokens, pooled vector, reference latent (the control image's: same size by default)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    x0 = randn(2, 16, *size)
    return (x0, randn(*x0.shape), torch.tensor([0.25, 0.8], dtype=torch.float64), randn(2, 5, 48), randn(2, 32),
            randn(2, 16, *(reference_size or size)))


def test_a_kontext_file_is_detected_as_flux_and_trains_as_kontext_only_when_asked():
    """Kontext dev has Flux dev's layout: ComfyUI (and PipeTrain's detection) call the file Flux."""
    from pipetrain.backend.models import loading, registry, tiny

    sd = {k: s for k, s, _ in tiny.tensor_plan(tiny.build_diffusion_model("flux_kontext", "tiny"))}
    assert loading.arch_from_state_dict_shapes(sd) == "flux"
    adapter = registry.adapter_class("flux_kontext")
    assert adapter.needs_control and adapter.conditioning_fields == ("reference",)
    assert adapter.spec.comfy_configs == ("Flux",) and adapter.spec.text_encoders == ("clip_l", "t5xxl")


@pytest.mark.parametrize("reference_size", [None, (4, 8)])
def test_layers_match_comfyui_forward_with_reference_latents(small_kontext, reference_size):
    a = small_kontext
    x0, noise, t, *text = inputs = _inputs(reference_size=reference_size)
    ours = layers_match_comfyui_forward(a, inputs)
    with torch.no_grad():
        without = a.diffusion_model(a.objective().noisy(x0, noise, t), t, text[0], y=text[1],
                                    guidance=torch.full_like(t, 2.5))
    assert (ours - without).abs().max() > 1e-3   # the reference matters


def test_cached_reference_is_what_comfyuis_reference_latent_gives_the_network(small_kontext):
    """ComfyUI's ReferenceLatent conditioning holds the raw VAE latent; ``model_base.Flux.extra_conds`` scales it
    into ``ref_latents``. The cache holds the control image's latent scaled the same way."""
    a = small_kontext
    raw = torch.randn(1, 16, 6, 10, dtype=torch.float64)

    class VAE:
        def encode(self, pixels):
            assert pixels.shape == (1, 48, 80, 3)
            return raw

    control, media = torch.rand(1, 48, 80, 3), torch.rand(1, 48, 80, 3)
    cached = a.encode_conditioning(VAE(), media, control)["reference"]
    conds = a.patcher.model.extra_conds(reference_latents=[raw], cross_attn=torch.zeros(1, 5, 48),
                                        pooled_output=torch.zeros(1, 32), noise=torch.zeros(1, 16, 6, 10),
                                        device="cpu")
    assert torch.allclose(cached.double(), conds["ref_latents"].cond[0][0])
    with pytest.raises(ModelError, match="control_path"):
        a.encode_conditioning(VAE(), media, None)


def test_training_targets_agree_with_comfyui_flow_sampling(small_kontext):
    a = small_kontext
    model, objective = a.patcher.model, a.objective()
    ms = model.model_sampling
    x0, noise, t, context, pooled, reference = inputs = _inputs()
    x_comfy = ms.noise_scaling(t, noise, x0)
    assert torch.allclose(ms.calculate_input(t, x_comfy), objective.noisy(x0, noise, t))
    with torch.no_grad():
        comfy_denoised = model.apply_model(x_comfy, t, c_crossattn=context, y=pooled, guidance=torch.full_like(t, 2.5),
                                           ref_latents=[reference])
        ours = ms.calculate_denoised(t, run_layers(a.to_layers(), inputs), x_comfy)
    assert (comfy_denoised - ours).abs().max() / ours.abs().max() < 1e-6


def test_lora_gradients_match_finite_differences_of_comfyui_forward(small_kontext):
    a = small_kontext
    dm = a.diffusion_model
    names = injection.inject(dm, injection.AdapterSpec(rank=4, alpha=4.0, dtype=torch.float64), a.lora_block_prefixes)
    assert "double_blocks.0.img_attn.qkv" in names and "single_blocks.1.linear2" in names
    give_lora_b_values(dm)
    lora_gradients_match_finite_differences(a, _inputs(), eps=1e-4)   # ComfyUI's RoPE runs in float32


def test_every_layer_boundary_can_be_a_deepspeed_stage_boundary(small_kontext):
    a = small_kontext
    every_boundary_is_a_stage_boundary_with_lora(a, _inputs())
