"""Qwen-Image-Edit-2509 (``qwen_image_edit_plus``) layers against ComfyUI's QwenImage forward with several
reference latents (``ref_latents`` at RoPE index 1, 2, ...): the same output, LoRA gradients equal to finite
differences of that forward, training targets ComfyUI's flow sampling turns back into the clean latent, the cached
references as ComfyUI's Wan VAE gives each control image, and tuples DeepSpeed's pipeline can cut anywhere."""
import pytest
import torch
from layer_checks import (comfy_model, every_boundary_is_a_stage_boundary_with_lora, flow_targets_agree_with_comfyui,
                          give_lora_b_values, layers_match_comfyui_forward, lora_gradients_match_finite_differences)

from pipetrain.backend.adapters import injection
from pipetrain.backend.config import ModelConfig
from pipetrain.backend.host.runtime import ensure_comfyui

ensure_comfyui()
TEXT = 24


@pytest.fixture(scope="module")
def small_plus():
    """ComfyUI's own ``model_base.QwenImage`` in float64: width 64 (2 heads of 32), 2 blocks."""
    from pipetrain.backend.models.qwen_image import QwenImageEditPlusAdapter, qwen_image_config

    config = qwen_image_config(2, num_attention_heads=2, attention_head_dim=32, axes_dims_rope=(8, 12, 12),
                               joint_attention_dim=TEXT)
    adapter = QwenImageEditPlusAdapter(ModelConfig(type="qwen_image_edit_plus", diffusion_model="unused",
                                                   vae="unused"))
    adapter.dtype = torch.float64
    adapter.use_model(comfy_model("qwen_image_edit_plus", config, std=0.08))
    return adapter


def _inputs(refs=3, size=(5, 7), lengths=(9, 5), seed=1):
    """Two samples, an odd latent grid, captions of different lengths (zero-padded), ``refs`` references each."""
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(2, 16, 1, *size, generator=g, dtype=torch.float64)
    noise = torch.randn(x0.shape, generator=g, dtype=torch.float64)
    lengths = torch.tensor(lengths)
    context = torch.randn(2, int(lengths.max()), TEXT, generator=g, dtype=torch.float64)
    for i, n in enumerate(lengths):
        context[i, n:] = 0
    references = torch.randn(2, refs, *x0.shape[1:], generator=g, dtype=torch.float64)
    return x0, noise, torch.tensor([0.25, 0.8], dtype=torch.float64), context, lengths, references


def test_the_plus_type_takes_up_to_three_control_folders():
    from pipetrain.backend.data import check_control_paths
    from pipetrain.backend.config.dataset import DatasetConfig, DirectoryConfig
    from pipetrain.backend.errors import DatasetError
    from pipetrain.backend.models.registry import adapter_class

    plus, edit = adapter_class("qwen_image_edit_plus"), adapter_class("qwen_image_edit")
    assert plus.max_controls == 3 and edit.max_controls == 1 and plus.caption_sees_control
    three = DatasetConfig(directory=[DirectoryConfig(path="a", control_path=["c1", "c2", "c3"])])
    check_control_paths(three, plus, "dataset")
    with pytest.raises(DatasetError, match="qwen_image_edit_plus"):
        check_control_paths(three, edit, "dataset")
    four = DatasetConfig(directory=[DirectoryConfig(path="a", control_path=["c1", "c2", "c3", "c4"])])
    with pytest.raises(DatasetError, match="at most 3"):
        check_control_paths(four, plus, "dataset")
    mixed = DatasetConfig(directory=[DirectoryConfig(path="a", control_path=["c1", "c2"]),
                                     DirectoryConfig(path="b", control_path="c3")])
    with pytest.raises(DatasetError, match="same number"):
        check_control_paths(mixed, plus, "dataset")


@pytest.mark.parametrize("refs", [1, 3])
def test_layers_match_comfyui_forward_with_several_references(small_plus, refs):
    a = small_plus
    x0, noise, t, context, lengths, references = inputs = _inputs(refs)
    ours = layers_match_comfyui_forward(a, inputs)
    if refs > 1:   # each reference has its own RoPE index: their order matters
        swapped = layers_match_comfyui_forward(a, (*inputs[:-1], references.flip(1)))
        assert (ours - swapped).abs().max() > 1e-6


def test_cached_references_are_each_control_images_latent(small_plus):
    """ComfyUI's Wan VAE takes a batch of images as one clip's frames: each control image is encoded alone,
    scaled with the Wan21 latent format as ``model_base.QwenImage.extra_conds`` scales each reference."""
    import comfy.latent_formats

    a = small_plus
    seen = []

    class VAE:
        def encode(self, pixels):
            seen.append(pixels.shape)
            return torch.full((1, 16, 1, 6, 10), float(len(seen)))

    cached = a.encode_conditioning(VAE(), torch.rand(1, 48, 80, 3), torch.rand(2, 48, 80, 3))["references"]
    assert seen == [(1, 48, 80, 3)] * 2 and cached.shape == (2, 16, 1, 6, 10)
    fmt = comfy.latent_formats.Wan21()
    for k in range(2):
        assert torch.allclose(cached[k], fmt.process_in(torch.full((1, 16, 1, 6, 10), k + 1.0))[0])


def test_training_targets_agree_with_comfyui_flow_sampling(small_plus):
    x0, noise, t, context, lengths, references = _inputs(2)
    one = (x0[:1], noise[:1], t[:1], context[:1, :9], lengths[:1], references[:1])
    flow_targets_agree_with_comfyui(small_plus, one, c_crossattn=one[3], ref_latents=list(one[5].unbind(1)))


def test_lora_gradients_match_finite_differences_of_comfyui_forward(small_plus):
    a = small_plus
    dm = a.diffusion_model
    injection.inject(dm, injection.AdapterSpec(rank=4, alpha=4.0, dtype=torch.float64), a.lora_block_prefixes)
    give_lora_b_values(dm)
    lora_gradients_match_finite_differences(a, _inputs(2), eps=1e-5)
    every_boundary_is_a_stage_boundary_with_lora(a, _inputs(2))


def test_the_benchmark_probe_gives_references_at_the_training_latents_size(small_plus):
    """bench/models.py and the memory plan train on ``meta_trace.probe_inputs``: the stacked references take the
    latent's size there, as a real sample's do (else the figure would be for 8x8 references)."""
    from pipetrain.backend.models.meta_trace import probe_inputs

    x0, _, _, context, lengths, references = probe_inputs(small_plus, 80, 48, batch=2)
    assert x0.shape == (2, 16, 1, 6, 10) and references.shape == (2, 2, 16, 1, 6, 10)
    assert context.shape[0] == lengths.shape[0] == 2
