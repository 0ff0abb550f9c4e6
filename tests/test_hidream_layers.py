"""HiDream-I1 pipeline layers against ComfyUI's HiDreamImageTransformer2DModel, mixture-of-experts included:
the same output as its forward, LoRA gradients (experts included) equal to finite differences of that forward,
training targets ComfyUI's flow sampling turns back into the clean latent, captions of different Llama
lengths batched as if alone, and tuples DeepSpeed's pipeline can cut anywhere; plus the real layout ComfyUI
detects and the tiny files."""
import pytest
import torch
from layer_checks import (comfy_model, every_boundary_is_a_stage_boundary, give_lora_b_values,
                          lora_gradients_match_finite_differences, run_layers)

from pipetrain.backend import lora
from pipetrain.backend.config import ModelConfig
from pipetrain.backend.runtime import ensure_comfyui

ensure_comfyui()
T5, LLAMA, POOLED, LLAMA_LAYERS = 24, 20, 16, 3   # HiDream's: 4096, 4096, 2048, 32


@pytest.fixture(scope="module")
def small_hidream():
    """ComfyUI's own ``model_base.HiDream`` in float64: width 32 (2 heads of 16), 4 routed experts (top 2),
    2 double + 2 single blocks reading Llama layers [0, 2, 1, 2]."""
    from pipetrain.backend.models.hidream import HIDREAM_FULL, HiDreamAdapter

    config = {**HIDREAM_FULL, "attention_head_dim": 16, "axes_dims_rope": [8, 4, 4], "caption_channels": [T5, LLAMA],
              "llama_layers": [0, 2, 1, 2], "num_attention_heads": 2, "num_layers": 2, "num_single_layers": 2,
              "text_emb_dim": POOLED}
    adapter = HiDreamAdapter(ModelConfig(type="hidream", diffusion_model="unused", vae="unused"))
    adapter.dtype = torch.float64
    adapter.patcher = comfy_model("hidream", config, std=0.1)
    return adapter


def _inputs(batch=2, size=(6, 10), t5_tokens=(6, 6), llama_tokens=(5, 5), seed=1):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(batch, 16, *size, generator=g, dtype=torch.float64)
    noise = torch.randn(x0.shape, generator=g, dtype=torch.float64)
    t = torch.tensor([0.25, 0.8, 0.05][:batch], dtype=torch.float64)
    t5 = torch.randn(batch, max(t5_tokens), T5, generator=g, dtype=torch.float64)
    llama = torch.randn(batch, LLAMA_LAYERS, max(llama_tokens), LLAMA, generator=g, dtype=torch.float64)
    for i, (n, m) in enumerate(zip(t5_tokens, llama_tokens)):
        t5[i, n:] = 0
        llama[i, :, m:] = 0
    pooled = torch.randn(batch, POOLED, generator=g, dtype=torch.float64)
    return x0, noise, t, t5, llama, pooled, torch.tensor(t5_tokens), torch.tensor(llama_tokens)


def test_comfyui_detects_the_full_layout_as_hidream():
    import comfy.model_detection
    import comfy.supported_models

    from pipetrain.backend.models import loading, tiny
    from pipetrain.backend.models.hidream import HIDREAM_FULL

    plan = tiny.tensor_plan(tiny.build_diffusion_model("hidream", "full"))
    sd = {k: torch.empty(s, device="meta") for k, s, _ in plan}
    assert type(comfy.model_detection.model_config_from_unet(sd, "")) is comfy.supported_models.HiDream
    assert comfy.model_detection.detect_unet_config(sd, "") == HIDREAM_FULL
    assert loading.arch_from_state_dict_shapes({k: v.shape for k, v in sd.items()}) == "hidream"
    assert sum(v.numel() for v in sd.values()) > 17e9


def test_tiny_hidream_files_load_through_comfyui(model_files):
    """ComfyUI's HiDream text encoders on the tiny files: T5-XXL's first 128 tokens, every Llama layer's hidden
    states (at least 128 tokens), CLIP-L + CLIP-G pooled; the conditioning reaches the tiny model."""
    from pipetrain.backend.models import loading

    files = model_files("hidream")
    patcher = loading.load_diffusion_model(files.diffusion_model, torch.float32)
    assert type(patcher.model).__name__ == "HiDream"
    clip = loading.load_text_encoders(files.text_encoders, "hidream", torch.float32)
    out = clip.encode_from_tokens(clip.tokenize("a red cube on a table"), return_pooled=True, return_dict=True)
    assert out["cond"].shape == (1, 128, 4096) and out["pooled_output"].shape == (1, 2048)
    assert out["conditioning_llama3"].shape == (1, 4, 128, 64)
    vae = loading.load_vae(files.vae, arch="hidream")
    assert vae.latent_channels == 16


def test_layers_match_comfyui_forward(small_hidream):
    a = small_hidream
    x0, noise, t, *text = inputs = _inputs()
    layers = a.to_layers()
    assert [type(x).__name__ for x in layers] == ["HiDreamInput", "HiDreamDouble", "HiDreamDouble", "HiDreamJoin",
                                                  "HiDreamSingle", "HiDreamSingle", "HiDreamOutput"]
    with torch.no_grad():
        ours = run_layers(layers, inputs)
        ref = a.reference_forward(a.objective().noisy(x0, noise, t), t, text)
    assert ours.shape == x0.shape
    assert torch.allclose(ours, ref, atol=1e-10, rtol=1e-8), (ours - ref).abs().max()


def test_training_targets_agree_with_comfyui_flow_sampling(small_hidream):
    a = small_hidream
    model, objective = a.patcher.model, a.objective()
    ms = model.model_sampling
    assert objective.multiplier == ms.multiplier == 1000.0 and objective.shift is None and ms.shift == 1.0
    x0, noise, t, t5, llama, pooled, *_ = inputs = _inputs()
    x_comfy = ms.noise_scaling(t, noise, x0)
    assert torch.allclose(ms.calculate_input(t, x_comfy), objective.noisy(x0, noise, t))
    assert torch.allclose(ms.calculate_denoised(t, objective.target(x0, noise, t), x_comfy), x0)
    with torch.no_grad():
        comfy_denoised = model.apply_model(x_comfy, t, c_crossattn=t5, y=pooled, encoder_hidden_states_llama3=llama)
        ours = ms.calculate_denoised(t, run_layers(a.to_layers(), inputs), x_comfy)
    assert (comfy_denoised - ours).abs().max() / ours.abs().max() < 1e-6


def test_lora_gradients_match_finite_differences_of_comfyui_forward(small_hidream):
    a = small_hidream
    dm = a.diffusion_model
    names = lora.inject(dm, lora.LoRASpec(rank=4, alpha=4.0, dtype=torch.float64), a.lora_block_prefixes)
    # double: adaLN + 8 attention + shared expert 3 + 4 routed experts x 3 + text FFN 3; single: 1 + 4 + 3 + 12
    assert len(names) == 2 * 27 + 2 * 20
    assert {"double_stream_blocks.1.block.ff_i.experts.3.w2", "double_stream_blocks.0.block.attn1.to_k_t",
            "single_stream_blocks.1.block.ff_i.shared_experts.w1", "single_stream_blocks.0.block.adaLN_modulation.1",
            "double_stream_blocks.0.block.ff_t.w3"} <= set(names)
    give_lora_b_values(dm)
    # ComfyUI's RoPE runs in float32 (as for Flux and Wan); the expert routing does not flip within eps
    lora_gradients_match_finite_differences(a, _inputs(llama_tokens=(5, 3)), eps=1e-4, rtol=1e-4)


def test_captions_of_different_lengths_batch_like_comfyui(small_hidream):
    a = small_hidream
    x0, noise, t, t5, llama, pooled, *_ = _inputs(t5_tokens=(6, 4), llama_tokens=(7, 3))
    long = {"t5": t5[0], "llama": llama[0], "pooled": pooled[0]}
    short = {"t5": t5[1, :4], "llama": llama[1, :, :3], "pooled": pooled[1]}
    collated = a.collate_text([long, short])
    assert collated[1].shape == (2, LLAMA_LAYERS, 7, LLAMA) and collated[4].tolist() == [7, 3]
    assert collated[3].tolist() == [6, 4]
    with torch.no_grad():
        layers = a.to_layers()
        batched = run_layers(layers, (x0, noise, t, *collated))
        for i, item in enumerate((long, short)):
            alone = run_layers(layers, (x0[i:i + 1], noise[i:i + 1], t[i:i + 1], *a.collate_text([item])))
            assert torch.allclose(batched[i:i + 1], alone, atol=1e-10, rtol=1e-8)


def test_every_layer_boundary_can_be_a_deepspeed_stage_boundary(small_hidream):
    a = small_hidream
    if not list(lora.adapted_modules(a.diffusion_model)):
        lora.inject(a.diffusion_model, lora.LoRASpec(rank=2, alpha=2.0, dtype=torch.float64), a.lora_block_prefixes)
        give_lora_b_values(a.diffusion_model)
    every_boundary_is_a_stage_boundary(a, _inputs(llama_tokens=(5, 4)))
