"""Cosmos pipeline layers against ComfyUI's own networks. Cosmos-Predict2 (MiniTrainDIT) on one-frame Wan 2.1
latents: the same output as its forward, training targets that ComfyUI's COSMOS_RFLOW sampling (EDM sigma ->
rectified-flow time) turns back into the clean latent, LoRA gradients equal to finite differences of that
forward, and tuples DeepSpeed's pipeline can cut anywhere; plus the real-layout files and the old T5-XXL."""
import pytest
import torch
from layer_checks import (every_boundary_is_a_stage_boundary_with_lora, give_lora_b_values,
                          layers_match_comfyui_forward, lora_gradients_match_finite_differences, run_layers,
                          small_adapter)

from pipetrain.backend.adapters import injection
from pipetrain.backend.config import ModelConfig
from pipetrain.backend.host.runtime import ensure_comfyui

ensure_comfyui()
TEXT = 40   # the old T5-XXL's width is 1024


@pytest.fixture(scope="module")
def small_predict2():
    """ComfyUI's own ``model_base.CosmosPredict2`` in float64: width 64 (2 heads of 32), 2 blocks, adaLN-LoRA."""
    from pipetrain.backend.models.cosmos import CosmosPredict2Adapter, predict2_config

    config = {**predict2_config(64, 2, 2), "crossattn_emb_channels": TEXT, "adaln_lora_dim": 16}
    return small_adapter(CosmosPredict2Adapter, "cosmos_predict2", config, std=0.08)


def _inputs(batch=2, size=(6, 10), tokens=9, seed=1):
    """One-frame latents of 6 x 10 (an image); captions zero-padded as ComfyUI's T5 leaves them."""
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(batch, 16, 1, *size, generator=g, dtype=torch.float64)
    noise = torch.randn(x0.shape, generator=g, dtype=torch.float64)
    t = torch.tensor([0.25, 0.8, 0.05][:batch], dtype=torch.float64)
    cond = torch.randn(batch, tokens, TEXT, generator=g, dtype=torch.float64)
    cond[:, 6:] = 0
    return x0, noise, t, cond


def test_comfyui_detects_the_full_layout_and_builds_the_tiny_one_from_metadata(model_files):
    import comfy.model_detection
    import comfy.supported_models

    from pipetrain.backend.models import loading, tiny
    from pipetrain.backend.models.cosmos import PREDICT2_CONFIGS

    module = tiny.build_diffusion_model("cosmos_predict2", "full")
    sd = {k: torch.empty(s, device="meta") for k, s, _ in tiny.tensor_plan(module)}
    assert type(comfy.model_detection.model_config_from_unet(sd, "")) is comfy.supported_models.CosmosT2IPredict2
    assert comfy.model_detection.detect_unet_config(sd, "") == PREDICT2_CONFIGS["full"]
    assert loading.arch_from_state_dict_shapes({k: v.shape for k, v in sd.items()}) == "cosmos_predict2"
    assert 1.8e9 < sum(p.numel() for p in module.parameters()) < 2.2e9          # Cosmos-Predict2 2B
    files = model_files("cosmos_predict2")
    assert loading.detect_architecture(files.diffusion_model) == "cosmos_predict2"
    patcher = loading.load_diffusion_model(files.diffusion_model, torch.float32)
    assert type(patcher.model).__name__ == "CosmosPredict2" and patcher.model.diffusion_model.model_channels == 256


def test_tiny_cosmos_text_encoder_is_comfyuis_old_t5_xxl(model_files):
    """The original T5-XXL (ReLU, 1024 wide) under ComfyUI's name "t5xxl", config from the file's metadata;
    ComfyUI's detection calls a real-layout file T5_XXL_OLD."""
    import comfy.sd

    from pipetrain.backend.models import loading, tiny
    from pipetrain.backend.models.cosmos import CosmosPredict2Adapter

    full = tiny.build_text_encoder("t5xxl_old", tiny.text_encoder_config("t5xxl_old", "full"))
    sd = {k: torch.empty(s, device="meta") for k, s, _ in tiny.tensor_plan(full)}
    assert comfy.sd.detect_te_model(sd) is comfy.sd.TEModel.T5_XXL_OLD
    assert loading._real_te_kind({k: v.shape for k, v in sd.items()}) == "t5xxl_old"
    files = model_files("cosmos_predict2")
    clip = loading.load_text_encoders(files.text_encoders, "cosmos_predict2", torch.float32)
    assert type(clip.cond_stage_model.t5xxl.transformer).__name__ == "T5"
    adapter = CosmosPredict2Adapter(ModelConfig(type="cosmos_predict2", diffusion_model="unused", vae="unused"))
    cond = adapter.encode_caption(clip, "a red cube on a table")["cond"]
    assert cond.shape == (512, 1024)
    assert cond[20:].abs().sum() == 0 and cond[:5].abs().sum() > 0   # padding zeroed (and kept), as ComfyUI does
    vae = loading.load_vae(files.vae, arch="cosmos_predict2")
    latents = adapter.encode_images(vae, torch.rand(2, 32, 48, 3))
    assert latents.shape == (2, 16, 1, 4, 6)


def test_layers_match_comfyui_forward(small_predict2):
    a = small_predict2
    layers_match_comfyui_forward(a, _inputs())


def test_training_targets_agree_with_comfyui_cosmos_rflow_sampling(small_predict2):
    """ComfyUI samples in EDM sigmas: sigma = t / (1 - t) gives the same network input and timestep, and the
    velocity target gives back the clean latent."""
    a = small_predict2
    model, objective = a.patcher.model, a.objective()
    ms = model.model_sampling
    assert type(ms).__mro__[1].__name__ == "ModelSamplingCosmosRFlow" and objective.multiplier == 1.0
    x0, noise, t, context = inputs = _inputs()
    sigma = t / (1 - t)
    x_comfy = ms.noise_scaling(sigma, noise, x0)
    assert torch.allclose(ms.calculate_input(sigma, x_comfy), objective.noisy(x0, noise, t))
    assert torch.allclose(ms.timestep(sigma), objective.model_timestep(t))
    assert torch.allclose(ms.calculate_denoised(sigma, objective.target(x0, noise, t), x_comfy), x0)
    with torch.no_grad():
        comfy_denoised = model.apply_model(x_comfy, sigma, c_crossattn=context)
        ours = ms.calculate_denoised(sigma, run_layers(a.to_layers(), inputs), x_comfy)
    assert (comfy_denoised - ours).abs().max() / ours.abs().max() < 1e-6


def test_lora_gradients_match_finite_differences_of_comfyui_forward(small_predict2):
    a = small_predict2
    dm = a.diffusion_model
    names = injection.inject(dm, injection.AdapterSpec(rank=4, alpha=4.0, dtype=torch.float64), a.lora_block_prefixes)
    assert len(names) == 2 * 16 and "blocks.1.cross_attn.v_proj" in names and "blocks.0.mlp.layer2" in names
    assert "blocks.0.adaln_modulation_mlp.2" in names
    give_lora_b_values(dm)
    lora_gradients_match_finite_differences(a, _inputs(), eps=1e-5)


def test_every_layer_boundary_can_be_a_deepspeed_stage_boundary(small_predict2):
    a = small_predict2
    every_boundary_is_a_stage_boundary_with_lora(a, _inputs())
