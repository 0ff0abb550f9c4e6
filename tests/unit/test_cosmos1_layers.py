"""Cosmos 1.0 text-to-video pipeline layers against ComfyUI's own GeneralDIT: the real 7B / 14B layouts and the
tiny files as ComfyUI sees them (the CV8x8x8 tokenizer included), the same output as its forward, training
targets that ComfyUI's EDM sampling turns back into the clean latent, LoRA gradients equal to finite
differences of that forward, and tuples DeepSpeed's pipeline can cut anywhere."""
import math

import pytest
import torch
from layer_checks import (comfyui_detects, every_boundary_is_a_stage_boundary_with_lora, give_lora_b_values,
                          layers_match_comfyui_forward, layout_state_dict, lora_gradients_match_finite_differences,
                          meta_state_dict, run_layers, small_adapter)

from pipetrain.backend.adapters import injection
from pipetrain.backend.config import ModelConfig
from pipetrain.backend.host.runtime import ensure_comfyui

ensure_comfyui()
TEXT = 40   # the old T5-XXL's width is 1024


@pytest.fixture(scope="module")
def small_cosmos1():
    """ComfyUI's own ``model_base.CosmosVideo`` in float64: width 64 (2 heads of 32), 2 blocks, adaLN-LoRA and
    the learnable extra position embedding added before every block. That embedding's ``normalize`` accumulates
    in float32, which torch refuses for float64 input: while these tests run it normalises a float32 copy (on
    both sides alike; the embedding is frozen)."""
    import comfy.ldm.cosmos.position_embedding as pe

    from pipetrain.backend.models.cosmos1 import Cosmos1Adapter, cosmos1_config

    normalize = pe.normalize
    config = {**cosmos1_config(64, 2, 2, rope=(1.0, 1.0, 2.0)), "crossattn_emb_channels": TEXT, "adaln_lora_dim": 16}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pe, "normalize", lambda x, dim=None, eps=0: normalize(x.float(), dim, eps).to(x.dtype))
        yield small_adapter(Cosmos1Adapter, "cosmos", config, std=0.08)


def _inputs(batch=2, frames=2, size=(6, 10), tokens=9, seed=1):
    """Two-frame latents of 6 x 10; captions zero-padded as ComfyUI's T5 leaves them."""
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(batch, 16, frames, *size, generator=g, dtype=torch.float64)
    noise = torch.randn(x0.shape, generator=g, dtype=torch.float64)
    t = torch.tensor([0.25, 0.8, 0.05][:batch], dtype=torch.float64)
    cond = torch.randn(batch, tokens, TEXT, generator=g, dtype=torch.float64)
    cond[:, 6:] = 0
    return x0, noise, t, cond


def test_comfyui_detects_the_7b_and_14b_layouts_and_builds_the_tiny_one_from_metadata(model_files):
    from pipetrain.backend.models import loading, tiny
    from pipetrain.backend.models.cosmos1 import COSMOS1_CONFIGS, COSMOS1_SPEC

    sd = layout_state_dict("cosmos", "full")
    comfyui_detects(sd, "cosmos", "CosmosT2V", COSMOS1_CONFIGS["full"])
    assert 7.0e9 < sum(v.numel() for v in sd.values()) < 7.5e9                    # Cosmos-1.0-Diffusion-7B
    sd14 = meta_state_dict(COSMOS1_SPEC.build(COSMOS1_CONFIGS["full_14b"]))
    comfyui_detects(sd14, "cosmos", "CosmosT2V", COSMOS1_CONFIGS["full_14b"])
    assert 14.0e9 < sum(v.numel() for v in sd14.values()) < 14.5e9
    files = model_files("cosmos")
    assert loading.detect_architecture(files.diffusion_model) == "cosmos"
    patcher = loading.load_diffusion_model(files.diffusion_model, torch.float32)
    assert type(patcher.model).__name__ == "CosmosVideo" and patcher.model.diffusion_model.model_channels == 256
    assert not tiny.build_vae("cosmos", "full").state_dict().keys() & {"decoder.unpatcher3d.wavelets"}


def test_tiny_cv8x8x8_tokenizer_and_old_t5_load_through_comfyui(model_files):
    """ComfyUI recognises the tiny tokenizer by its decoder's wavelets (an extra tensor: the module does not
    save that buffer), narrowed through the file's metadata; 8k + 1 frames give k + 1 latent frames."""
    from safetensors import safe_open

    from pipetrain.backend.models import loading
    from pipetrain.backend.models.cosmos1 import Cosmos1Adapter

    files = model_files("cosmos")
    vae = loading.load_vae(files.vae, arch="cosmos")
    model = vae.first_stage_model
    assert type(model).__name__ == "CausalContinuousVideoTokenizer" and vae.latent_dim == 3
    with safe_open(str(files.vae), framework="pt") as f:
        keys = set(f.keys())
        assert torch.allclose(f.get_tensor("decoder.unpatcher3d.wavelets"), model.decoder.unpatcher3d.wavelets)
    assert set(model.state_dict()) == keys - {"encoder.patcher3d.wavelets", "decoder.unpatcher3d.wavelets"}
    assert torch.equal(model.latent_std, torch.ones(256)) and torch.equal(model.latent_mean, torch.zeros(256))
    adapter = Cosmos1Adapter(ModelConfig(type="cosmos", diffusion_model="unused", vae="unused"))
    assert adapter.encode_video(vae, torch.rand(17, 32, 48, 3)).shape == (16, 3, 4, 6)
    assert adapter.encode_images(vae, torch.rand(2, 32, 48, 3)).shape == (2, 16, 1, 4, 6)
    clip = loading.load_text_encoders(files.text_encoders, "cosmos", torch.float32)
    cond = adapter.encode_caption(clip, "a red cube on a table")["cond"]
    assert cond.shape == (512, 1024)
    assert cond[20:].abs().sum() == 0 and cond[:5].abs().sum() > 0   # padding zeroed (and kept), as ComfyUI does


def test_layers_match_comfyui_forward(small_cosmos1):
    layers_match_comfyui_forward(small_cosmos1, _inputs(),
                                 ["Cosmos1Input", "Cosmos1Block", "Cosmos1Block", "Cosmos1Output"])


def test_training_targets_agree_with_comfyui_edm_sampling(small_cosmos1):
    """ComfyUI samples in EDM sigmas (sigma = t / (1 - t) here): the same network input and timestep, the target
    gives back the clean latent, its MSE is EDM's weighted denoiser loss, and log sigma ~ N(0, 1)."""
    a = small_cosmos1
    model, objective = a.patcher.model, a.objective()
    ms = model.model_sampling
    assert type(ms).__mro__[1].__name__ == "ModelSamplingContinuousEDM" and ms.sigma_data == 0.5
    x0, noise, t, context = inputs = _inputs()
    sigma = t / (1 - t)
    x_comfy = ms.noise_scaling(sigma, noise, x0)
    assert torch.allclose(ms.calculate_input(sigma, x_comfy), objective.noisy(x0, noise, t))
    assert torch.allclose(ms.timestep(sigma), objective.model_timestep(t))
    target = objective.target(x0, noise, t)
    assert torch.allclose(ms.calculate_denoised(sigma, target, x_comfy), x0)
    with torch.no_grad():
        out = run_layers(a.to_layers(), inputs)
        comfy_denoised = model.apply_model(x_comfy, sigma, c_crossattn=context)
        ours = ms.calculate_denoised(sigma, out, x_comfy)
    assert (comfy_denoised - ours).abs().max() / ours.abs().max() < 1e-6
    s = sigma.reshape(-1, 1, 1, 1, 1)
    edm_weight = (s ** 2 + 0.25) / (s * 0.5) ** 2
    assert torch.allclose(a.loss(out, (x0, noise, t)), (edm_weight * (ours - x0) ** 2).mean())
    quantiles = (0.5, 0.5 * (1 + math.erf(0.5 ** 0.5)))   # the median and mean + 1 sd of a normal
    median, one_sd = (float(objective.sigma(objective.quantile_t(q, 0))) for q in quantiles)
    assert math.isclose(median, 1.0, rel_tol=1e-5) and math.isclose(one_sd, math.e, rel_tol=1e-4)


def test_lora_gradients_match_finite_differences_of_comfyui_forward(small_cosmos1):
    a = small_cosmos1
    dm = a.diffusion_model
    names = injection.inject(dm, injection.AdapterSpec(rank=4, alpha=4.0, dtype=torch.float64), a.lora_block_prefixes)
    assert len(names) == 2 * 16 and "blocks.block1.blocks.1.block.attn.to_v.0" in names
    assert {"blocks.block0.blocks.2.block.layer2", "blocks.block0.blocks.0.adaLN_modulation.2"} <= set(names)
    give_lora_b_values(dm)
    lora_gradients_match_finite_differences(a, _inputs(), eps=1e-5)


def test_every_layer_boundary_can_be_a_deepspeed_stage_boundary(small_cosmos1):
    every_boundary_is_a_stage_boundary_with_lora(small_cosmos1, _inputs())
