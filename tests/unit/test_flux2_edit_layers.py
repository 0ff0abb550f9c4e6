"""Flux 2 edit pipeline layers against ComfyUI's Flux 2 forward with reference latents (``ref_latents``, its
"index" method: the k-th reference at RoPE index 10 k): the same output, LoRA gradients equal to finite
differences of that forward, training targets ComfyUI's flow sampling turns back into the clean latent, the
cached references equal to what ComfyUI's ReferenceLatent conditioning gives the network, and tuples DeepSpeed's
pipeline can cut anywhere."""
import pytest
import torch
from layer_checks import (comfy_model, every_boundary_is_a_stage_boundary_with_lora, flow_targets_agree_with_comfyui,
                          give_lora_b_values, layers_match_comfyui_forward, layout_state_dict,
                          lora_gradients_match_finite_differences)

from pipetrain.backend.adapters import injection
from pipetrain.backend.config import ModelConfig
from pipetrain.backend.errors import ModelError
from pipetrain.backend.host.runtime import ensure_comfyui

ensure_comfyui()
TEXT = 24


@pytest.fixture(scope="module")
def small_edit():
    """ComfyUI's own ``model_base.Flux2`` in float64: width 64 (2 heads of 32), 1 double + 1 single block."""
    from pipetrain.backend.models.flux2 import FLUX2_DEV
    from pipetrain.backend.models.flux2_edit import Flux2EditAdapter

    config = {**FLUX2_DEV, "hidden_size": 64, "num_heads": 2, "axes_dim": [8, 8, 8, 8], "context_in_dim": TEXT,
              "depth": 1, "depth_single_blocks": 1}
    adapter = Flux2EditAdapter(ModelConfig(type="flux2_edit", diffusion_model="unused", vae="unused", guidance=4.0))
    adapter.dtype = torch.float64
    adapter.use_model(comfy_model("flux2_edit", config, std=0.08))
    return adapter


def _inputs(adapter, size=(3, 5), refs=2, seed=1):
    """x0, noise, t, Mistral text (left-padded), two reference latents [B, 2, 128, h, w]."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    x0 = randn(2, 128, *size)
    (context,) = adapter.collate_text([{"mistral": randn(n, TEXT)} for n in (6, 3)])
    return x0, randn(*x0.shape), torch.tensor([0.25, 0.8], dtype=torch.float64), context, randn(2, refs, 128, *size)


def test_a_flux2_file_is_detected_as_flux2_and_trains_with_references_only_when_asked():
    from pipetrain.backend.config import compat
    from pipetrain.backend.models import loading, registry

    sd = layout_state_dict("flux2_edit", "full")
    assert loading.arch_from_state_dict_shapes({k: v.shape for k, v in sd.items()}) == "flux2"
    adapter = registry.adapter_class("flux2_edit")
    assert adapter.needs_control and adapter.conditioning_fields == ("references",) and adapter.max_controls == 10
    # diffusion-pipe's flux2 with control images in the dataset is this type
    assert compat.edit_type("flux2", True) == "flux2_edit" and compat.edit_type("flux2", False) == "flux2"


def test_layers_match_comfyui_forward_with_reference_latents(small_edit):
    a = small_edit
    x0, noise, t, context, refs = inputs = _inputs(a)
    ours = layers_match_comfyui_forward(a, inputs, atol=1e-9)
    swapped = layers_match_comfyui_forward(a, (x0, noise, t, context, refs.flip(1)), atol=1e-9)
    assert (ours - swapped).abs().max() > 1e-6     # each reference has its own RoPE index: the order matters
    one = layers_match_comfyui_forward(a, (x0, noise, t, context, refs[:, :1]), atol=1e-9)
    assert (ours - one).abs().max() > 1e-4


def test_cached_references_are_what_comfyuis_reference_latent_gives_the_network(small_edit):
    """ReferenceLatent holds raw VAE latents; ``model_base.Flux.extra_conds`` scales each into ``ref_latents``.
    The cache holds the control images' latents scaled the same way, in control_path's order."""
    a = small_edit
    raw = torch.randn(2, 128, 3, 5, dtype=torch.float64)

    class VAE:
        def encode(self, pixels):
            assert pixels.shape == (2, 48, 80, 3)
            return raw

    cached = a.encode_conditioning(VAE(), torch.rand(1, 48, 80, 3), torch.rand(2, 48, 80, 3))["references"]
    conds = a.patcher.model.extra_conds(reference_latents=[raw[:1], raw[1:]], cross_attn=torch.zeros(1, 5, TEXT), pooled_output=None,
                                        noise=torch.zeros(1, 128, 3, 5), device="cpu")
    for k in range(2):
        assert torch.allclose(cached[k].double(), conds["ref_latents"].cond[k][0])
    with pytest.raises(ModelError, match="control_path"):
        a.encode_conditioning(VAE(), torch.rand(1, 48, 80, 3), None)


def test_training_targets_agree_with_comfyui_flow_sampling(small_edit):
    a = small_edit
    inputs = _inputs(a)
    t, context, refs = inputs[2], inputs[3], inputs[4]
    flow_targets_agree_with_comfyui(a, inputs, c_crossattn=context, guidance=torch.full_like(t, 4.0),
                                    ref_latents=list(refs.unbind(1)))


def test_lora_gradients_match_finite_differences_of_comfyui_forward(small_edit):
    a = small_edit
    dm = a.diffusion_model
    names = injection.inject(dm, injection.AdapterSpec(rank=4, alpha=4.0, dtype=torch.float64), a.lora_block_prefixes)
    assert "double_blocks.0.img_attn.qkv" in names and "single_blocks.0.linear2" in names
    give_lora_b_values(dm)
    lora_gradients_match_finite_differences(a, _inputs(a), eps=1e-4)   # ComfyUI's RoPE runs in float32
    every_boundary_is_a_stage_boundary_with_lora(a, _inputs(a))


def test_the_benchmark_probe_gives_references_at_the_training_latents_size(small_edit):
    from pipetrain.backend.models.meta_trace import probe_inputs

    x0, _, _, _, references = probe_inputs(small_edit, 80, 48)
    assert x0.shape == (1, 128, 3, 5) and references.shape == (1, 2, 128, 3, 5)
