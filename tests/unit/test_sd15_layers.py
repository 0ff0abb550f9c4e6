# SPDX-License-Identifier: GPL-3.0-or-later
"""SD 1.x and SD 2.x pipeline layers against ComfyUI (float64): the same output as its UNet forward, LoRA
gradients equal to finite differences of that forward, training inputs/targets that ComfyUI's sampler (eps and v)
turns back into the clean latent, and tuples between layers that DeepSpeed's pipeline can send both ways."""
import pytest
import torch
from layer_checks import (captions_batch_as_if_alone, comfyui_detects, discrete_targets_agree_with_comfyui,
                          every_boundary_is_a_stage_boundary_with_lora, give_lora_b_values,
                          layers_match_comfyui_forward, layout_state_dict,
                          lora_gradients_match_finite_differences, small_adapter)

from pipetrain.backend.adapters import injection
from pipetrain.backend.host.runtime import ensure_comfyui

CONTEXT_DIM = 64   # SD 1.x's is 768, SD 2.x's 1024
ARCHS = ("sd15", "sd2")


@pytest.fixture(scope="module", params=ARCHS)
def small_sd(request):
    """The adapter over ComfyUI's own ``model_base.BaseModel`` (UNet + model_sampling) for SD15 / SD20 in float64
    with tiny widths."""
    ensure_comfyui()
    from pipetrain.backend.models.registry import adapter_class, arch_spec

    arch = request.param
    adapter = small_adapter(adapter_class(arch), arch, {**arch_spec(arch).unet_config("tiny"),
                                                        "context_dim": CONTEXT_DIM})
    adapter.check_model()
    # SD20 asks ComfyUI's attention for float32 scores (against fp16 overflow); on the CPU its attention then casts
    # the float64 test model's q and k down (1e-9 off), where SDPA, which training and ComfyUI on a GPU use, keeps them
    for m in adapter.diffusion_model.modules():
        if hasattr(m, "attn_precision"):
            m.attn_precision = None
    return adapter


def _inputs(batch=2, size=(6, 10), tokens=7, seed=1):
    """Odd latent sides on purpose: upsampling must follow the skips' shapes (6x10 -> 3x5 -> 2x3 -> 1x2 and back)."""
    g = torch.Generator().manual_seed(seed)
    x0, noise = torch.randn(2, batch, 4, *size, generator=g, dtype=torch.float64)
    timesteps = torch.tensor([10.0, 800.0, 0.0, 999.0][:batch])
    return x0, noise, timesteps, torch.randn(batch, tokens, CONTEXT_DIM, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("arch, comfy_class", [("sd15", "SD15"), ("sd2", "SD20")])
def test_full_size_layouts_are_what_comfyui_detects_from_published_weights(arch, comfy_class):
    from pipetrain.backend.models.registry import arch_spec

    ensure_comfyui()
    full = arch_spec(arch).unet_config("full")
    detected = {k: v for k, v in full.items() if k not in ("num_heads", "num_head_channels")}  # ComfyUI adds these
    comfyui_detects(layout_state_dict(arch, "full"), arch, comfy_class, detected)


def test_layout_and_layer_split(small_sd):
    from pipetrain.backend.models.sd15 import SD_TRANSFORMERS
    from pipetrain.backend.models.sdxl import transformer_paths

    a = small_sd
    dm = a.diffusion_model
    assert sorted(transformer_paths(dm)) == sorted(SD_TRANSFORMERS) and len(SD_TRANSFORMERS) == 16
    layers = a.to_layers()
    assert [type(x).__name__ for x in layers] == (["UNetInput"] + ["InputBlock"] * 12 + ["MiddleBlock"]
                                                  + ["OutputBlock"] * 12 + ["SDXLOutput"])
    assert all(a.layer_cost(layer) > 0 for layer in layers)


def test_full_size_sd15_costs_about_its_published_flops():
    """Costs come from module shapes only, so the 860M UNet is costed on the meta device at 512x512."""
    from pipetrain.backend.models.sd15 import build_sd_unet, SD15_UNET_FULL
    from pipetrain.backend.models.sdxl import _resolution_factor, block_tflop

    dm = build_sd_unet(SD15_UNET_FULL)
    pixels, total = 64 * 64, 0.0
    for block in [*dm.input_blocks, dm.middle_block, *dm.output_blocks]:
        total += block_tflop(block, pixels)
        pixels = int(pixels * _resolution_factor(block))
    assert pixels == 64 * 64
    assert 0.6 < total + block_tflop(dm.out, pixels) < 1.0, total   # ~0.8 TFLOP a forward (0.4 T multiply-adds)


def test_layers_match_comfyui_forward(small_sd):
    layers_match_comfyui_forward(small_sd, _inputs())


def test_restated_conv_spatial_transformer_is_comfyuis_and_keeps_channels_last(small_sd):
    """SD 1.x's SpatialTransformers project with 1x1 convolutions: the re-stated forward equals ComfyUI's (output
    and input gradient) and hands a channels-last activation on channels-last."""
    import functools

    from comfy.ldm.modules.attention import SpatialTransformer
    from pipetrain.backend.models.sdxl import Norms, spatial_transformer_forward

    st = small_sd.diffusion_model.input_blocks[4][1]
    assert type(st) is SpatialTransformer and st.use_linear == (small_sd.arch == "sd2")
    g = torch.Generator().manual_seed(3)
    context = torch.randn(2, 7, CONTEXT_DIM, generator=g, dtype=torch.float64)
    x = torch.randn(2, st.in_channels, 3, 5, generator=g, dtype=torch.float64)
    x = x.contiguous(memory_format=torch.channels_last)
    outs = []
    for forward in (functools.partial(SpatialTransformer.forward, st),
                    functools.partial(spatial_transformer_forward, st, Norms())):
        leaf = x.detach().clone(memory_format=torch.preserve_format).requires_grad_(True)
        out = forward(leaf, context, {})
        out.square().sum().backward()
        outs.append((out.detach(), leaf.grad))
    (ref, ref_grad), (ours, ours_grad) = outs
    assert torch.allclose(ours, ref, atol=1e-12) and torch.allclose(ours_grad, ref_grad, atol=1e-12)
    assert ours.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("prediction", ["eps", "v"])
def test_training_inputs_and_targets_agree_with_comfyui_sampling(small_sd, prediction):
    """What the UNet sees in training is what ComfyUI's ``apply_model`` feeds it for the same noisy latent, and a
    perfect prediction of the training target is denoised by ComfyUI to the clean latent; the prediction is the
    one ComfyUI's model_sampling samples with."""
    inputs = _inputs(batch=4)
    discrete_targets_agree_with_comfyui(small_sd, prediction, inputs, cross_attn=inputs[3])


def test_lora_gradients_match_finite_differences_of_comfyui_forward(small_sd):
    a = small_sd
    dm = a.diffusion_model
    names = injection.inject(dm, injection.AdapterSpec(rank=4, alpha=4.0, dtype=torch.float64), a.lora_block_prefixes)
    linears = {n for n, m in dm.named_modules() if isinstance(m, torch.nn.Linear)
               and any(n.startswith(p + ".") for p in a.lora_block_prefixes) and n.split(".")[-1] not in
               ("lora_A", "lora_B")}
    assert set(names) == linears   # every linear of every SpatialTransformer, nothing of the ResBlocks
    # attention q/k/v/out x 2 and the feed-forward's 2; SD 2.x projects in and out with linears too
    assert len(names) == 16 * (12 if a.arch == "sd2" else 10)
    assert ("input_blocks.1.1.proj_in" in names) == (a.arch == "sd2")
    assert "output_blocks.11.1.transformer_blocks.0.attn2.to_k" in names
    give_lora_b_values(dm)
    lora_gradients_match_finite_differences(a, _inputs())


def test_every_layer_boundary_can_be_a_deepspeed_stage_boundary(small_sd):
    every_boundary_is_a_stage_boundary_with_lora(small_sd, _inputs())


def test_captions_of_different_lengths_batch_like_comfyui(small_sd):
    """A 2-chunk caption batched with a 1-chunk one gives each sample its own unbatched output."""
    x0, noise, t, _ = _inputs()
    short, long = torch.randn(3, CONTEXT_DIM, dtype=torch.float64), torch.randn(6, CONTEXT_DIM, dtype=torch.float64)
    (cond,) = captions_batch_as_if_alone(small_sd, x0, noise, t, [{"cond": short}, {"cond": long}])
    assert cond.shape == (2, 6, CONTEXT_DIM)


def test_caption_encoding_keeps_only_the_cross_attention_context(small_sd):
    """SD 1.x / 2.x take no pooled vector: only ``cond`` is cached, as ComfyUI's CLIP encodes it."""
    class Clip:
        def tokenize(self, caption):
            return caption

        def encode_from_tokens(self, tokens, return_pooled, return_dict):
            return {"cond": torch.ones(1, 77, CONTEXT_DIM), "pooled_output": torch.zeros(1, 16)}

    encoded = small_sd.encode_caption(Clip(), "a cube")
    assert list(encoded) == ["cond"] and encoded["cond"].shape == (77, CONTEXT_DIM)


@pytest.mark.parametrize("arch", ARCHS)
def test_parity_check_every_run_makes_passes_with_every_lora_getting_a_gradient(arch):
    """The start-of-run parity check (``parity/check.py``, float64 on ComfyUI's own model): its probe latent is large
    enough that the middle block's self-attention sees more than one position (at 8x8 its q and k got no gradient),
    and SD 2.x's float32 attention precision is no difference of ours."""
    from pipetrain.backend.config import ModelConfig
    from pipetrain.backend.models.registry import adapter_class
    from pipetrain.backend.parity.check import check_model_type

    adapter = adapter_class(arch)(ModelConfig(type=arch, diffusion_model="unused", vae="unused"))
    assert min(adapter.probe_latent(torch.Generator().manual_seed(0)).shape[-2:]) // 8 >= 2   # after 3 downsamplings
    result = check_model_type(arch, use_memo=False)
    assert result.ok, result.message()
    assert result.lora_keys == 16 * (12 if arch == "sd2" else 10)
    assert result.max_difference <= 1e-12 * result.scale and result.lora_difference <= 1e-12 * result.scale
