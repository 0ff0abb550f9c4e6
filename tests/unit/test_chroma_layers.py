"""Chroma pipeline layers against ComfyUI's ``comfy.ldm.chroma`` model: the same output as its forward, LoRA
gradients equal to finite differences of that forward (which cannot run backward: in-place residuals),
captions of different lengths batched as if alone, and tuples DeepSpeed's pipeline can cut anywhere."""
import pytest
import torch
from layer_checks import (captions_batch_as_if_alone, every_boundary_is_a_stage_boundary_with_lora, give_lora_b_values,
                          layers_match_comfyui_forward, lora_gradients_match_finite_differences, small_adapter)

from pipetrain.backend.adapters import injection
from pipetrain.backend.host.runtime import ensure_comfyui

ensure_comfyui()
CONTEXT = 40   # T5-XXL's is 4096


@pytest.fixture(scope="module")
def small_chroma():
    """ComfyUI's own ``model_base.Chroma`` in float64: width 64 (4 heads), 2 double + 2 single blocks."""
    from pipetrain.backend.models.chroma import CHROMA_TINY, ChromaAdapter

    config = {**CHROMA_TINY, "hidden_size": 64, "axes_dim": [4, 6, 6], "out_dim": 64, "hidden_dim": 48,
              "context_in_dim": CONTEXT}
    return small_adapter(ChromaAdapter, "chroma", config, std=0.08)


def _inputs(batch=2, size=(6, 10), tokens=(5, 5), seed=1):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(batch, 16, *size, generator=g, dtype=torch.float64)
    noise = torch.randn(x0.shape, generator=g, dtype=torch.float64)
    t = torch.tensor([0.25, 0.8, 0.05][:batch], dtype=torch.float64)
    t5 = torch.randn(batch, max(tokens), CONTEXT, generator=g, dtype=torch.float64)
    for i, n in enumerate(tokens):
        t5[i, n:] = 0
    return x0, noise, t, t5, torch.tensor(tokens)


def test_comfyui_detects_the_chroma_layout():
    """At Chroma's real width (ComfyUI pins it) with 1 double + 1 single block, and at the full size."""
    import comfy.model_detection
    import comfy.supported_models

    from pipetrain.backend.models import loading, tiny
    from pipetrain.backend.models.chroma import CHROMA_FULL, build_chroma

    for config in ({**CHROMA_FULL, "depth": 1, "depth_single_blocks": 1}, CHROMA_FULL):
        sd = {k: torch.empty(s, device="meta") for k, s, _ in tiny.tensor_plan(build_chroma(config))}
        assert type(comfy.model_detection.model_config_from_unet(sd, "")) is comfy.supported_models.Chroma
        assert comfy.model_detection.detect_unet_config(sd, "") == config
        assert loading.arch_from_state_dict_shapes({k: v.shape for k, v in sd.items()}) == "chroma"


def test_tiny_chroma_file_loads_through_its_metadata(model_files):
    import comfy.supported_models

    from pipetrain.backend.models import loading
    from pipetrain.backend.models.chroma import CHROMA_TINY

    files = model_files("chroma")
    shapes, metadata = loading.read_header(files.diffusion_model)
    # ComfyUI's detection recognises the layout but would pin 24 heads of 128: the config comes from metadata
    assert loading.arch_from_state_dict_shapes(shapes) == "chroma" and "pipetrain.unet_config" in metadata
    assert loading.detect_architecture(files.diffusion_model) == "chroma"
    patcher = loading.load_diffusion_model(files.diffusion_model, torch.float32)
    assert type(patcher.model.model_config) is comfy.supported_models.Chroma
    assert patcher.model.diffusion_model.params.hidden_size == CHROMA_TINY["hidden_size"]
    clip = loading.load_text_encoders(files.text_encoders, "chroma", torch.float32)
    cond = clip.encode_from_tokens(clip.tokenize("a red cube"), return_dict=True)["cond"]
    assert cond.shape[0] == 1 and cond.shape[2] == 4096 and cond.shape[1] < 77  # unpadded (PixArt tokenizer)


def test_layers_match_comfyui_forward(small_chroma):
    a = small_chroma
    layers_match_comfyui_forward(a, _inputs())


def test_lora_gradients_match_finite_differences_of_comfyui_forward(small_chroma):
    a = small_chroma
    dm = a.diffusion_model
    names = injection.inject(dm, injection.AdapterSpec(rank=4, alpha=4.0, dtype=torch.float64), a.lora_block_prefixes)
    assert len(names) == 2 * 8 + 2 * 2 and "double_blocks.1.txt_mlp.2" in names and "single_blocks.0.linear1" in names
    give_lora_b_values(dm)
    # eps 1e-4: ComfyUI applies RoPE in float32 (comfy.ldm.flux.math), which limits finite differences
    lora_gradients_match_finite_differences(a, _inputs(tokens=(5, 3)), eps=1e-4)


def test_comfyui_block_forward_really_breaks_autograd(small_chroma):
    a = small_chroma
    x0, noise, t, t5, lengths = _inputs()
    x = a.objective().noisy(x0, noise, t).requires_grad_(True)
    with pytest.raises(RuntimeError, match="inplace"):
        a.reference_forward(x, t, [t5, lengths]).sum().backward()


def test_captions_of_different_lengths_batch_like_comfyui(small_chroma):
    a = small_chroma
    x0, noise, t, t5, _ = _inputs(tokens=(7, 2))
    long, short = {"t5": t5[0]}, {"t5": t5[1, :2]}
    collated = captions_batch_as_if_alone(a, x0, noise, t, [long, short])
    assert collated[0].shape == (2, 7, CONTEXT) and collated[1].tolist() == [7, 2]


def test_every_layer_boundary_can_be_a_deepspeed_stage_boundary(small_chroma):
    a = small_chroma
    every_boundary_is_a_stage_boundary_with_lora(a, _inputs(tokens=(5, 4)))
