"""AuraFlow pipeline layers against ComfyUI's MMDiT: the same output as its forward, LoRA gradients equal to
finite differences of that forward, training targets ComfyUI's flow sampling (shift 1.73, multiplier 1) turns
back into the clean latent, captions of different lengths batched as if alone, and tuples DeepSpeed's
pipeline can cut anywhere; plus the real layout ComfyUI detects and the tiny files."""
import pytest
import torch
from layer_checks import (comfy_model, every_boundary_is_a_stage_boundary, give_lora_b_values,
                          lora_gradients_match_finite_differences, run_layers)

from pipetrain.backend import lora
from pipetrain.backend.config import ModelConfig
from pipetrain.backend.runtime import ensure_comfyui

ensure_comfyui()
CONTEXT = 24   # Pile-T5-XL's width is 2048


@pytest.fixture(scope="module")
def small_aura():
    """ComfyUI's own ``model_base.AuraFlow`` in float64: width 64 (2 heads of 32), 2 double + 1 single layer,
    an 8 x 8 position table."""
    from pipetrain.backend.models.auraflow import AuraFlowAdapter, aura_config

    config = aura_config(64, CONTEXT, 2, 3, dim=64, n_heads=2, global_conddim=64)
    adapter = AuraFlowAdapter(ModelConfig(type="auraflow", diffusion_model="unused", vae="unused"))
    adapter.dtype = torch.float64
    adapter.patcher = comfy_model("auraflow", config, std=0.08)
    return adapter


def _inputs(batch=2, size=(6, 10), tokens=(5, 5), seed=1):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(batch, 4, *size, generator=g, dtype=torch.float64)
    noise = torch.randn(x0.shape, generator=g, dtype=torch.float64)
    t = torch.tensor([0.25, 0.8, 0.05][:batch], dtype=torch.float64)
    cond = torch.randn(batch, max(tokens), CONTEXT, generator=g, dtype=torch.float64)
    for i, n in enumerate(tokens):
        cond[i, n:] = 0
    return x0, noise, t, cond, torch.tensor(tokens)


def test_comfyui_detects_the_full_layout_as_auraflow():
    import comfy.model_detection
    import comfy.supported_models

    from pipetrain.backend.models import loading, tiny
    from pipetrain.backend.models.auraflow import AURA_CONFIGS

    plan = tiny.tensor_plan(tiny.build_diffusion_model("auraflow", "full"))
    sd = {k: torch.empty(s, device="meta") for k, s, _ in plan}
    assert type(comfy.model_detection.model_config_from_unet(sd, "")) is comfy.supported_models.AuraFlow
    assert comfy.model_detection.detect_unet_config(sd, "") == AURA_CONFIGS["full"]
    assert loading.arch_from_state_dict_shapes({k: v.shape for k, v in sd.items()}) == "auraflow"


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
    x0, noise, t, *text = inputs = _inputs()
    layers = a.to_layers()
    assert [type(x).__name__ for x in layers] == ["AuraInput", "AuraDouble", "AuraDouble", "AuraJoin", "AuraSingle",
                                                  "AuraOutput"]
    with torch.no_grad():
        ours = run_layers(layers, inputs)
        ref = a.reference_forward(a.objective().noisy(x0, noise, t), t, text)
    assert ours.shape == x0.shape
    assert torch.allclose(ours, ref, atol=1e-10, rtol=1e-8), (ours - ref).abs().max()


def test_training_targets_agree_with_comfyui_flow_sampling(small_aura):
    a = small_aura
    model, objective = a.patcher.model, a.objective()
    ms = model.model_sampling
    assert (objective.shift, objective.multiplier) == (pytest.approx(1.73), 1.0) and ms.multiplier == 1.0
    assert ms.shift == pytest.approx(objective.shift)
    x0, noise, t, cond, lengths = inputs = _inputs()
    x_comfy = ms.noise_scaling(t, noise, x0)
    assert torch.allclose(ms.calculate_input(t, x_comfy), objective.noisy(x0, noise, t))
    assert torch.allclose(ms.calculate_denoised(t, objective.target(x0, noise, t), x_comfy), x0)
    assert torch.equal(ms.timestep(t), objective.model_timestep(t))
    with torch.no_grad():
        comfy_denoised = model.apply_model(x_comfy, t, c_crossattn=cond)
        ours = ms.calculate_denoised(t, run_layers(a.to_layers(), inputs), x_comfy)
    assert (comfy_denoised - ours).abs().max() / ours.abs().max() < 1e-6


def test_lora_gradients_match_finite_differences_of_comfyui_forward(small_aura):
    a = small_aura
    dm = a.diffusion_model
    names = lora.inject(dm, lora.LoRASpec(rank=4, alpha=4.0, dtype=torch.float64), a.lora_block_prefixes)
    # per double layer: 8 attention projections, 2 SwiGLU MLPs of 3, 2 modulations; per single layer: 4 + 3 + 1
    assert len(names) == 2 * 16 + 8
    assert {"double_layers.1.attn.w2o", "double_layers.0.modC.1", "single_layers.0.mlp.c_proj"} <= set(names)
    give_lora_b_values(dm)
    lora_gradients_match_finite_differences(a, _inputs(tokens=(5, 3)))


def test_captions_of_different_lengths_batch_like_comfyui(small_aura):
    a = small_aura
    x0, noise, t, cond, lengths = _inputs(tokens=(7, 3))
    long, short = {"cond": cond[0]}, {"cond": cond[1, :3]}
    collated = a.collate_text([long, short])
    assert collated[0].shape == (2, 7, CONTEXT) and collated[1].tolist() == [7, 3]
    with torch.no_grad():
        layers = a.to_layers()
        batched = run_layers(layers, (x0, noise, t, *collated))
        for i, item in enumerate((long, short)):
            alone = run_layers(layers, (x0[i:i + 1], noise[i:i + 1], t[i:i + 1], *a.collate_text([item])))
            assert torch.allclose(batched[i:i + 1], alone, atol=1e-10, rtol=1e-8)


def test_every_layer_boundary_can_be_a_deepspeed_stage_boundary(small_aura):
    a = small_aura
    if not list(lora.adapted_modules(a.diffusion_model)):
        lora.inject(a.diffusion_model, lora.LoRASpec(rank=2, alpha=2.0, dtype=torch.float64), a.lora_block_prefixes)
        give_lora_b_values(a.diffusion_model)
    every_boundary_is_a_stage_boundary(a, _inputs(tokens=(5, 4)))
