"""HiDream-I1 pipeline layers against ComfyUI's HiDreamImageTransformer2DModel, mixture-of-experts included:
the same output as its forward, LoRA gradients (experts included) equal to finite differences of that forward,
training targets ComfyUI's flow sampling turns back into the clean latent, captions of different Llama
lengths batched as if alone, and tuples DeepSpeed's pipeline can cut anywhere; plus the real layout ComfyUI
detects and the tiny files."""
import pytest
import torch
from layer_checks import (captions_batch_as_if_alone, comfyui_detects, every_boundary_is_a_stage_boundary_with_lora,
                          flow_targets_agree_with_comfyui, give_lora_b_values, layers_match_comfyui_forward,
                          layout_state_dict, lora_gradients_match_finite_differences, small_adapter)

from pipetrain.backend.adapters import injection
from pipetrain.backend.host.runtime import ensure_comfyui

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
    return small_adapter(HiDreamAdapter, "hidream", config, std=0.1)


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
    from pipetrain.backend.models.hidream import HIDREAM_FULL

    sd = layout_state_dict("hidream", "full")
    comfyui_detects(sd, "hidream", "HiDream", HIDREAM_FULL)
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
    layers_match_comfyui_forward(a, _inputs(), ["HiDreamInput", "HiDreamDouble", "HiDreamDouble", "HiDreamJoin",
                                                "HiDreamSingle", "HiDreamSingle", "HiDreamOutput"])


def test_training_targets_agree_with_comfyui_flow_sampling(small_hidream):
    a = small_hidream
    model, objective = a.patcher.model, a.objective()
    ms = model.model_sampling
    assert objective.multiplier == ms.multiplier == 1000.0 and objective.shift is None and ms.shift == 1.0
    x0, noise, t, t5, llama, pooled, *_ = inputs = _inputs()
    flow_targets_agree_with_comfyui(a, inputs, c_crossattn=t5, y=pooled, encoder_hidden_states_llama3=llama)


def test_lora_gradients_match_finite_differences_of_comfyui_forward(small_hidream):
    a = small_hidream
    dm = a.diffusion_model
    names = injection.inject(dm, injection.AdapterSpec(rank=4, alpha=4.0, dtype=torch.float64), a.lora_block_prefixes)
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
    collated = captions_batch_as_if_alone(a, x0, noise, t, [long, short])
    assert collated[1].shape == (2, LLAMA_LAYERS, 7, LLAMA) and collated[4].tolist() == [7, 3]
    assert collated[3].tolist() == [6, 4]


def test_every_layer_boundary_can_be_a_deepspeed_stage_boundary(small_hidream):
    a = small_hidream
    every_boundary_is_a_stage_boundary_with_lora(a, _inputs(llama_tokens=(5, 4)))
