"""Wan 2.1 pipeline layers against ComfyUI's WanModel on 5-D video latents: the same output as its forward,
LoRA gradients equal to finite differences of that forward, training targets ComfyUI's flow sampling turns
back into the clean latent, and tuples DeepSpeed's pipeline can cut anywhere; plus the real-layout files."""
import pytest
import torch
from layer_checks import (every_boundary_is_a_stage_boundary_with_lora, flow_targets_agree_with_comfyui,
                          give_lora_b_values, layers_match_comfyui_forward, lora_gradients_match_finite_differences,
                          small_adapter)

from pipetrain.backend.adapters import injection
from pipetrain.backend.host.runtime import ensure_comfyui

ensure_comfyui()
TEXT = 48   # UMT5-XXL's width is 4096


@pytest.fixture(scope="module")
def small_wan():
    """ComfyUI's own ``model_base.WAN21`` in float64: width 64 (2 heads of 32), 2 blocks."""
    from pipetrain.backend.models.wan import WanAdapter, wan_config

    config = {**wan_config(64, 96, 2), "num_heads": 2, "text_dim": TEXT, "freq_dim": 32}
    return small_adapter(WanAdapter, "wan", config, std=0.08)


def _inputs(batch=2, size=(3, 6, 10), tokens=7, seed=1):
    """3 latent frames (a 9-frame clip) of 6 x 10: odd patch counts on purpose."""
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(batch, 16, *size, generator=g, dtype=torch.float64)
    noise = torch.randn(x0.shape, generator=g, dtype=torch.float64)
    t = torch.tensor([0.25, 0.8, 0.05][:batch], dtype=torch.float64)
    return x0, noise, t, torch.randn(batch, tokens, TEXT, generator=g, dtype=torch.float64)


def test_comfyui_detects_the_tiny_and_full_layouts_as_wan21_t2v():
    import comfy.model_detection
    import comfy.supported_models

    from pipetrain.backend.models import loading, tiny
    from pipetrain.backend.models.wan import WAN_CONFIGS

    for size in ("tiny", "full"):
        sd = {k: torch.empty(s, device="meta") for k, s, _ in tiny.tensor_plan(tiny.build_diffusion_model("wan", size))}
        assert type(comfy.model_detection.model_config_from_unet(sd, "")) is comfy.supported_models.WAN21_T2V
        assert comfy.model_detection.detect_unet_config(sd, "") == WAN_CONFIGS[size]
        assert loading.arch_from_state_dict_shapes({k: v.shape for k, v in sd.items()}) == "wan"


def test_tiny_wan_files_load_through_comfyui(model_files):
    """The diffusion model and VAE through ComfyUI's own detection; UMT5 through its metadata, with the
    SentencePiece tokenizer stored in the file as real UMT5 files store theirs."""
    import comfy.sd

    from pipetrain.backend.models import loading

    files = model_files("wan")
    patcher = loading.load_diffusion_model(files.diffusion_model, torch.float32)
    assert type(patcher.model).__name__ == "WAN21" and patcher.model.diffusion_model.dim == 256
    vae = loading.load_vae(files.vae, arch="wan")
    assert type(vae.first_stage_model).__name__ == "WanVAE"
    assert vae.encode(torch.rand(9, 32, 48, 3)).shape == (1, 16, 3, 4, 6)   # 9 frames -> 3 latent frames
    with pytest.raises(Exception, match="encodes videos"):
        loading.load_vae(model_files("chroma").vae, arch="wan")   # Flux's 16-channel image VAE
    shapes, meta = loading.read_header(files.text_encoders[0])
    assert meta["pipetrain.te_kind"] == "umt5xxl" and "spiece_model" in shapes
    # 2 narrow layers: ComfyUI alone would not take it for UMT5-XXL, the file's metadata says what it is
    assert comfy.sd.detect_te_model({k: torch.empty(s, device="meta") for k, s in shapes.items()
                                     if k != "spiece_model"}) is not comfy.sd.TEModel.T5_XXL
    clip = loading.load_text_encoders(files.text_encoders, "wan", torch.float32)
    cond = clip.encode_from_tokens(clip.tokenize("a red cube slides left"), return_dict=True)["cond"]
    assert cond.shape == (1, 512, 4096)
    assert cond[0, 20:].abs().sum() == 0 and cond[0, :5].abs().sum() > 0   # padding zeroed, as ComfyUI does


def test_layers_match_comfyui_forward(small_wan):
    a = small_wan
    layers_match_comfyui_forward(a, _inputs())


def test_training_targets_agree_with_comfyui_flow_sampling(small_wan):
    a = small_wan
    model, objective = a.patcher.model, a.objective()
    ms = model.model_sampling
    assert objective.multiplier == ms.multiplier == 1000.0 and objective.shift is None
    x0, noise, t, context = inputs = _inputs()
    flow_targets_agree_with_comfyui(a, inputs, c_crossattn=context)


def test_lora_gradients_match_finite_differences_of_comfyui_forward(small_wan):
    a = small_wan
    dm = a.diffusion_model
    names = injection.inject(dm, injection.AdapterSpec(rank=4, alpha=4.0, dtype=torch.float64), a.lora_block_prefixes)
    assert len(names) == 2 * 10 and "blocks.1.cross_attn.v" in names and "blocks.0.ffn.2" in names
    give_lora_b_values(dm)
    lora_gradients_match_finite_differences(a, _inputs(), eps=1e-4)   # ComfyUI's RoPE runs in float32


def test_every_layer_boundary_can_be_a_deepspeed_stage_boundary(small_wan):
    a = small_wan
    every_boundary_is_a_stage_boundary_with_lora(a, _inputs())
