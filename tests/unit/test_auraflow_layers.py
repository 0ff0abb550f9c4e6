"""AuraFlow pipeline layers against ComfyUI's MMDiT: the same output as its forward, LoRA gradients equal to
finite differences of that forward, training targets ComfyUI's flow sampling (shift 1.73, multiplier 1) turns
back into the clean latent, captions of different lengths batched as if alone, and tuples DeepSpeed's
pipeline can cut anywhere; plus the real layout ComfyUI detects and the tiny files."""
import pytest
import torch
from layer_checks import (captions_batch_as_if_alone, comfyui_detects, every_boundary_is_a_stage_boundary_with_lora,
                          flow_targets_agree_with_comfyui, give_lora_b_values, layers_match_comfyui_forward,
                          layout_state_dict, lora_gradients_match_finite_differences, padded_caption_inputs,
                          small_adapter)

from pipetrain.backend.adapters import injection
from pipetrain.backend.host.runtime import ensure_comfyui

ensure_comfyui()
CONTEXT = 24   # Pile-T5-XL's width is 2048


@pytest.fixture(scope="module")
def small_aura():
    """ComfyUI's own ``model_base.AuraFlow`` in float64: width 64 (2 heads of 32), 2 double + 1 single layer,
    an 8 x 8 position table."""
    from pipetrain.backend.models.auraflow import AuraFlowAdapter, aura_config

    config = aura_config(64, CONTEXT, 2, 3, dim=64, n_heads=2, global_conddim=64)
    return small_adapter(AuraFlowAdapter, "auraflow", config, std=0.08)


def _inputs(batch=2, size=(6, 10), tokens=(5, 5), seed=1):
    return padded_caption_inputs(4, size, tokens, CONTEXT, batch, seed)[0]


def test_comfyui_detects_the_full_layout_as_auraflow():
    from pipetrain.backend.models.auraflow import AURA_CONFIGS

    sd = layout_state_dict("auraflow", "full")
    comfyui_detects(sd, "auraflow", "AuraFlow", AURA_CONFIGS["full"])


def test_tiny_auraflow_files_load_through_comfyui(model_files):
    """The diffusion model through its metadata, the SDXL VAE through ComfyUI's detection, Pile-T5 through
    its metadata with the tokenizer ComfyUI ships: at least 256 tokens, the padding zeroed."""
    from pipetrain.backend.models import loading

    files = model_files("auraflow")
    patcher = loading.load_diffusion_model(files.diffusion_model, torch.float32)
    assert type(patcher.model).__name__ == "AuraFlow"
    assert patcher.model.diffusion_model.cond_seq_linear.in_features == 256
    assert patcher.model.model_sampling.shift == pytest.approx(1.73) and patcher.model.model_sampling.multiplier == 1.0
    vae = loading.load_vae(files.vae, arch="auraflow")
    assert vae.latent_channels == 4
    clip = loading.load_text_encoders(files.text_encoders, "auraflow", torch.float32)
    cond = clip.encode_from_tokens(clip.tokenize("a red cube on a table"), return_dict=True)["cond"]
    assert cond.shape == (1, 256, 256)
    assert cond[0, 20:].abs().sum() == 0 and cond[0, :5].abs().sum() > 0


def test_layers_match_comfyui_forward(small_aura):
    a = small_aura
    layers_match_comfyui_forward(a, _inputs(), ["AuraInput", "AuraDouble", "AuraDouble", "AuraJoin", "AuraSingle",
                                                "AuraOutput"])


def test_training_targets_agree_with_comfyui_flow_sampling(small_aura):
    a = small_aura
    model, objective = a.patcher.model, a.objective()
    ms = model.model_sampling
    assert (objective.shift, objective.multiplier) == (pytest.approx(1.73), 1.0) and ms.multiplier == 1.0
    assert ms.shift == pytest.approx(objective.shift)
    x0, noise, t, cond, lengths = inputs = _inputs()
    flow_targets_agree_with_comfyui(a, inputs, c_crossattn=cond)


def test_lora_gradients_match_finite_differences_of_comfyui_forward(small_aura):
    a = small_aura
    dm = a.diffusion_model
    names = injection.inject(dm, injection.AdapterSpec(rank=4, alpha=4.0, dtype=torch.float64), a.lora_block_prefixes)
    # per double layer: 8 attention projections, 2 SwiGLU MLPs of 3, 2 modulations; per single layer: 4 + 3 + 1
    assert len(names) == 2 * 16 + 8
    assert {"double_layers.1.attn.w2o", "double_layers.0.modC.1", "single_layers.0.mlp.c_proj"} <= set(names)
    give_lora_b_values(dm)
    lora_gradients_match_finite_differences(a, _inputs(tokens=(5, 3)))


def test_captions_of_different_lengths_batch_like_comfyui(small_aura):
    a = small_aura
    x0, noise, t, cond, lengths = _inputs(tokens=(7, 3))
    long, short = {"cond": cond[0]}, {"cond": cond[1, :3]}
    collated = captions_batch_as_if_alone(a, x0, noise, t, [long, short])
    assert collated[0].shape == (2, 7, CONTEXT) and collated[1].tolist() == [7, 3]


def test_every_layer_boundary_can_be_a_deepspeed_stage_boundary(small_aura):
    a = small_aura
    every_boundary_is_a_stage_boundary_with_lora(a, _inputs(tokens=(5, 4)))
