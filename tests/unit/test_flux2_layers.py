"""Flux 2 pipeline layers against ComfyUI's Flux with Flux 2's parameters (shared modulation, 4-axis RoPE,
128-channel latents, bias-free SwiGLU blocks): the same output as its forward, LoRA gradients equal to finite
differences of that forward, training targets ComfyUI's flow sampling turns back into the clean latent, text
padded as ComfyUI pads it, and tuples DeepSpeed's pipeline can cut anywhere; plus the real-layout files and the
tiny files (Mistral text encoder with its tekken tokenizer in the file, Flux 2 VAE) through ComfyUI."""
import pytest
import torch
from layer_checks import (comfy_model, every_boundary_is_a_stage_boundary_with_lora, flow_targets_agree_with_comfyui,
                          give_lora_b_values, layers_match_comfyui_forward, lora_gradients_match_finite_differences)

from pipetrain.backend.adapters import injection
from pipetrain.backend.config import ModelConfig
from pipetrain.backend.host.runtime import ensure_comfyui

ensure_comfyui()
TEXT = 24   # Mistral's is 3 x 5120


@pytest.fixture(scope="module")
def small_flux2():
    """ComfyUI's own ``model_base.Flux2`` in float64: width 64 (2 heads of 32), 2 double + 2 single blocks."""
    from pipetrain.backend.models.flux2 import FLUX2_DEV, Flux2Adapter

    config = {**FLUX2_DEV, "hidden_size": 64, "num_heads": 2, "axes_dim": [8, 8, 8, 8], "context_in_dim": TEXT,
              "depth": 2, "depth_single_blocks": 2}
    adapter = Flux2Adapter(ModelConfig(type="flux2", diffusion_model="unused", vae="unused", guidance=4.0))
    adapter.dtype = torch.float64
    adapter.use_model(comfy_model("flux2", config, std=0.08))
    return adapter


def _inputs(adapter=None, batch=2, size=(3, 5), lengths=(7, 4), seed=1):
    """Odd latent sides; captions of different lengths, collated (left-padded to 512) as training does."""
    from pipetrain.backend.models.flux2 import Flux2Adapter

    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(batch, 128, *size, generator=g, dtype=torch.float64)
    noise = torch.randn(x0.shape, generator=g, dtype=torch.float64)
    t = torch.tensor([0.25, 0.8, 0.05][:batch], dtype=torch.float64)
    captions = [{"mistral": torch.randn(n, TEXT, generator=g, dtype=torch.float64)} for n in lengths[:batch]]
    (context,) = (adapter or Flux2Adapter.__new__(Flux2Adapter)).collate_text(captions)
    return x0, noise, t, context


def _meta(module):
    from pipetrain.backend.models import tiny
    return {k: torch.empty(s, device="meta") for k, s, _ in tiny.tensor_plan(module)}


def test_comfyui_detects_the_full_layout_as_flux2_dev():
    import comfy.model_detection
    import comfy.supported_models

    from pipetrain.backend.models import loading, tiny
    from pipetrain.backend.models.flux2 import FLUX2_DEV

    sd = _meta(tiny.build_diffusion_model("flux2", "full"))
    assert type(comfy.model_detection.model_config_from_unet(sd, "")) is comfy.supported_models.Flux2
    assert comfy.model_detection.detect_unet_config(sd, "") == FLUX2_DEV
    assert loading.arch_from_state_dict_shapes({k: v.shape for k, v in sd.items()}) == "flux2"
    assert 31e9 < sum(v.numel() for v in sd.values()) < 33e9          # "32B"


def test_comfyui_takes_full_and_pruned_mistral_files_for_flux2s_text_encoder():
    import comfy.sd

    from pipetrain.backend.models import loading, tiny

    full = tiny.build_text_encoder("mistral3_24b", tiny.text_encoder_config("mistral3_24b", "full"))
    sd = _meta(full)
    assert comfy.sd.detect_te_model(sd) is comfy.sd.TEModel.MISTRAL3_24B
    pruned = {k: v for k, v in sd.items() if not k.startswith(tuple(f"model.layers.{i}." for i in range(30, 40)))}
    assert comfy.sd.detect_te_model(pruned) is comfy.sd.TEModel.MISTRAL3_24B_PRUNED_FLUX2
    for shapes in (sd, pruned):
        assert loading._real_te_kind({k: v.shape for k, v in shapes.items()}) == "mistral3_24b"


def test_tiny_flux2_files_load_through_comfyui(model_files):
    """The diffusion model through its metadata; the VAE through ComfyUI's Flux 2 VAE detection (narrowed);
    Mistral with its tekken tokenizer stored in the file as real files store theirs, tokenized by ComfyUI's
    Flux 2 tokenizer (system prompt and [INST] template, Mistral's special ids)."""
    from pipetrain.backend.models import loading

    files = model_files("flux2")
    patcher = loading.load_diffusion_model(files.diffusion_model, torch.float32)
    assert type(patcher.model).__name__ == "Flux2" and patcher.model.diffusion_model.params.context_in_dim == 192
    assert loading.detect_architecture(files.diffusion_model) == "flux2"
    vae = loading.load_vae(files.vae, arch="flux2")
    assert vae.latent_channels == 128 and vae.first_stage_model.bn is not None
    assert vae.encode(torch.rand(1, 64, 96, 3)).shape == (1, 128, 4, 6)   # 16x
    shapes, meta = loading.read_header(files.text_encoders[0])
    assert meta["pipetrain.te_kind"] == "mistral3_24b" and "tekken_model" in shapes
    clip = loading.load_text_encoders(files.text_encoders, "flux2", torch.float32)
    tokens = clip.tokenize("a red cube")
    ids = [i for i, *_ in tokens["mistral3_24b"][0]]
    assert ids[:2] == [1, 17] and ids[-1] == 4                              # <s> [SYSTEM_PROMPT] ... [/INST]
    inner = clip.tokenizer.mistral3_24b.tokenizer
    assert inner.decode(ids[-11:-1]) == "a red cube"
    cond = clip.encode_from_tokens(tokens, return_dict=True)["cond"]
    assert cond.shape == (1, len(ids), 192)                                 # layers 10, 20, 30 side by side
    other = clip.encode_from_tokens(clip.tokenize("a blue sphere"), return_dict=True)["cond"]
    assert not torch.allclose(cond[0, -3:], other[0, -3:])


def test_layers_match_comfyui_forward(small_flux2):
    a = small_flux2
    x0, noise, t, context = inputs = _inputs(a)
    assert context.shape == (2, 512, TEXT)
    layers_match_comfyui_forward(a, inputs)


def test_text_is_padded_as_comfyui_pads_flux2s(small_flux2):
    """ComfyUI's Flux 2 left-pads each caption with zero tokens to 512; a batch is padded the same way, so
    every sample sees what ComfyUI shows the network for it alone."""
    x0, _, _, context = _inputs(small_flux2, lengths=(7, 4))
    for i, n in enumerate((7, 4)):
        conds = small_flux2.patcher.model.extra_conds(cross_attn=context[i:i + 1, -n:], noise=x0[i:i + 1],
                                                      pooled_output=None, device="cpu")
        assert torch.equal(conds["c_crossattn"].cond, context[i:i + 1])
        assert context[i, :-n].abs().sum() == 0


def test_training_targets_agree_with_comfyui_flow_sampling(small_flux2):
    a = small_flux2
    model, objective = a.patcher.model, a.objective()
    ms = model.model_sampling
    import comfy.model_sampling
    assert isinstance(ms, comfy.model_sampling.ModelSamplingFlux)   # the network takes t itself
    assert objective.multiplier == 1.0 and objective.shift == 3.0
    x0, noise, t, context = inputs = _inputs(a)
    flow_targets_agree_with_comfyui(a, inputs, c_crossattn=context, guidance=torch.full_like(t, 4.0))


def test_lora_gradients_match_finite_differences_of_comfyui_forward(small_flux2):
    a = small_flux2
    dm = a.diffusion_model
    names = injection.inject(dm, injection.AdapterSpec(rank=4, alpha=4.0, dtype=torch.float64), a.lora_block_prefixes)
    assert len(names) == 2 * 8 + 2 * 2   # qkv, proj and 2 MLP linears per stream; linear1 / linear2
    assert "double_blocks.1.txt_mlp.2" in names and "single_blocks.0.linear1" in names
    assert not any("modulation" in n for n in names)   # the shared modulation layers sit outside the blocks
    give_lora_b_values(dm)
    lora_gradients_match_finite_differences(a, _inputs(a), eps=1e-4)   # ComfyUI's RoPE runs in float32


def test_every_layer_boundary_can_be_a_deepspeed_stage_boundary(small_flux2):
    a = small_flux2
    every_boundary_is_a_stage_boundary_with_lora(a, _inputs(a))
