"""SDXL pipeline layers against ComfyUI: the same output as its UNet forward, LoRA gradients equal to finite
differences of that forward, training inputs/targets that ComfyUI's sampler turns back into the clean latent,
and tuples between layers that DeepSpeed's pipeline can send both ways."""
import pytest
import torch
from layer_checks import (discrete_targets_agree_with_comfyui, every_boundary_is_a_stage_boundary, give_lora_b_values,
                          lora_gradients_match_finite_differences)

from pipetrain.backend.adapters import injection
from pipetrain.backend.config import ModelConfig
from pipetrain.backend.host.runtime import ensure_comfyui

CONTEXT_DIM = 64  # SDXL's is 2048; the pooled vector stays 1280 (ComfyUI's encode_adm makes y 2816)


@pytest.fixture(scope="module")
def small_sdxl():
    """ComfyUI's own ``model_base.SDXL`` (UNet + model_sampling + encode_adm) in float64 with tiny widths."""
    ensure_comfyui()
    from pipetrain.backend.models.loading import build_model
    from pipetrain.backend.models.sdxl import SDXL_UNET_TINY, SDXLAdapter

    patcher = build_model("sdxl", {**SDXL_UNET_TINY, "context_dim": CONTEXT_DIM}, torch.float64)
    torch.manual_seed(0)
    for p in patcher.model.diffusion_model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    adapter = SDXLAdapter(ModelConfig(type="sdxl", diffusion_model="unused", vae="unused"))
    adapter.dtype = torch.float64
    adapter.use_model(patcher)
    adapter.check_model()
    return adapter


def _inputs(batch=2, size=(6, 10), tokens=7, seed=1):
    """Odd latent sides on purpose: upsampling must follow the skips' shapes (6x10 -> 3x5 -> 2x3 and back)."""
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(batch, 4, *size, generator=g, dtype=torch.float64)
    noise = torch.randn(x0.shape, generator=g, dtype=torch.float64)
    t = torch.tensor([10.0, 800.0, 0.0, 999.0][:batch])
    cond = torch.randn(batch, tokens, CONTEXT_DIM, generator=g, dtype=torch.float64)
    pooled = torch.randn(batch, 1280, generator=g, dtype=torch.float64)
    return x0, noise, t, cond, pooled


def _run_layers(layers, inputs):
    h = inputs
    for layer in layers:
        h = layer(h)
    return h


def test_layout_and_layer_split(small_sdxl):
    from pipetrain.backend.models.sdxl import SDXL_TRANSFORMERS, transformer_paths

    a = small_sdxl
    dm = a.diffusion_model
    assert sorted(transformer_paths(dm)) == sorted(SDXL_TRANSFORMERS)
    layers = a.to_layers()
    assert len(layers) == 1 + len(dm.input_blocks) + 1 + len(dm.output_blocks) + 1 == 21
    assert all(a.layer_cost(layer) > 0 for layer in layers)


def test_full_size_costs_put_the_deep_transformer_levels_heaviest():
    """Costs come from module shapes only, so the 2.6B UNet can be costed on the meta device."""
    from pipetrain.backend.models.sdxl import REFERENCE_LATENT, _resolution_factor, block_tflop, build_sdxl_unet

    dm = build_sdxl_unet("full")
    pixels, costs = REFERENCE_LATENT[0] * REFERENCE_LATENT[1], []
    for block in dm.input_blocks:
        costs.append(block_tflop(block, pixels))
        pixels = int(pixels * _resolution_factor(block))
    assert pixels == 32 * 32
    costs.append(block_tflop(dm.middle_block, pixels))
    for block in dm.output_blocks:
        costs.append(block_tflop(block, pixels))
        pixels = int(pixels * _resolution_factor(block))
    # about 6 TFLOP for one forward at 1024x1024 (published estimates for SDXL's UNet are ~6 TFLOP)
    assert 4.0 < sum(costs) < 8.0, sum(costs)
    assert max(range(len(costs)), key=costs.__getitem__) in (7, 8, 10, 11, 12)  # level-2 blocks, 10 transformers


def test_layers_match_comfyui_forward(small_sdxl):
    a = small_sdxl
    x0, noise, t, cond, pooled = inputs = _inputs()
    with torch.no_grad():
        ours = _run_layers(a.to_layers(), inputs)
        ref = a.reference_forward(a.objective().noisy(x0, noise, t), t, [cond, pooled])
    assert ours.shape == x0.shape
    assert torch.allclose(ours, ref, atol=1e-10, rtol=1e-8), (ours - ref).abs().max()


def test_size_conditioning_is_comfyui_adm_made_once_per_bucket(small_sdxl):
    from pipetrain.backend.models.sdxl import SizeConditioning, comfy_adm

    encode_adm = small_sdxl.patcher.model.encode_adm
    calls = []
    conditioning = SizeConditioning(lambda **kw: calls.append(kw) or encode_adm(**kw))
    pooled = _inputs(batch=3)[4]
    for size in [(6, 10), (8, 8), (6, 10)]:
        latent = torch.zeros(3, 4, *size, dtype=torch.float64)
        y = conditioning(pooled, latent)
        assert torch.equal(y, comfy_adm(encode_adm, pooled, latent)), size
    assert [(c["width"], c["height"]) for c in calls] == [(80, 48), (64, 64)]


@pytest.mark.parametrize("layout", [torch.channels_last, torch.contiguous_format])
def test_norm_inputs_get_their_gradient_back_in_their_own_layout(layout):
    """The gradient a norm hands back arrives in the layout of the norm's input, whatever layout the norm's own
    backward made (CUDA's GroupNorm: NCHW), with the same values."""
    from pipetrain.backend.models.sdxl import _GradientInInputLayout

    other = torch.contiguous_format if layout == torch.channels_last else torch.channels_last
    x = torch.randn(2, 8, 4, 4).contiguous(memory_format=layout).requires_grad_()
    grad = torch.randn(2, 8, 4, 4).contiguous(memory_format=other)
    _GradientInInputLayout.apply(x).backward(grad)
    assert x.grad.is_contiguous(memory_format=layout) and torch.equal(x.grad, grad)


def _forward_and_grads(forward, x, *args):
    x = x.detach().clone(memory_format=torch.preserve_format).requires_grad_(True)
    out = forward(x, *args)
    out.square().sum().backward()
    return out.detach(), x.grad


@pytest.mark.parametrize("layout", [torch.channels_last, torch.contiguous_format])
def test_restated_blocks_keep_the_activation_layout_and_comfyui_maths(small_sdxl, layout):
    """The re-stated SpatialTransformer and ResBlock forwards equal ComfyUI's, output and input gradient, and
    hand a channels-last activation on channels-last (ComfyUI's SpatialTransformer makes it NCHW, which costs a
    copy and conversions after it)."""
    import functools

    from comfy.ldm.modules.attention import SpatialTransformer
    from comfy.ldm.modules.diffusionmodules.openaimodel import ResBlock
    from pipetrain.backend.models.sdxl import Norms, res_block_forward, restate_blocks, spatial_transformer_forward

    dm = small_sdxl.diffusion_model
    assert restate_blocks(dm, Norms()) == 11 + 17   # every SpatialTransformer and ResBlock of SDXL
    st, rb = dm.middle_block[1], dm.output_blocks[4][0]
    assert type(st) is SpatialTransformer and type(rb) is ResBlock and rb.channels != rb.out_channels
    g = torch.Generator().manual_seed(3)
    context = torch.randn(2, 7, CONTEXT_DIM, generator=g, dtype=torch.float64)
    emb = torch.randn(2, rb.emb_channels, generator=g, dtype=torch.float64)
    cases = ((functools.partial(SpatialTransformer.forward, st), functools.partial(spatial_transformer_forward, st,
              Norms()), st.in_channels, (context, {})),
             (functools.partial(ResBlock._forward, rb), functools.partial(res_block_forward, rb, Norms()),
              rb.channels, (emb,)))
    for comfy_forward, ours_forward, channels, args in cases:
        x = torch.randn(2, channels, 3, 5, generator=g, dtype=torch.float64).contiguous(memory_format=layout)
        (ref, ref_grad), (ours, ours_grad) = (_forward_and_grads(f, x, *args) for f in (comfy_forward, ours_forward))
        assert torch.allclose(ours, ref, atol=1e-12) and torch.allclose(ours_grad, ref_grad, atol=1e-12)
        assert ours.is_contiguous(memory_format=layout)
    if layout == torch.channels_last:   # what the SpatialTransformer's re-statement is for
        x = torch.randn(2, st.in_channels, 3, 5, generator=g, dtype=torch.float64).contiguous(memory_format=layout)
        ref_copies, ref = _copies(cases[0][0], x, context, {})
        ours_copies, _ = _copies(cases[0][1], x, context, {})
        assert not ref.is_contiguous(memory_format=torch.channels_last)
        assert ours_copies < ref_copies, (ours_copies, ref_copies)


def _copies(forward, *args):
    """(how many tensor copies ``forward(*args)`` makes, its output)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.clone, torch.ops.aten.copy_, torch.ops.aten._to_copy):
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Count():
        out = forward(*args)
    return Count.n, out


@pytest.mark.parametrize("prediction", ["eps", "v"])
def test_training_inputs_and_targets_agree_with_comfyui_sampling(small_sdxl, prediction):
    """What the UNet sees in training is what ComfyUI's ``apply_model`` feeds it for the same noisy latent,
    and a perfect prediction of the training target is denoised by ComfyUI to the clean latent."""
    x0, noise, t, cond, pooled = inputs = _inputs(batch=4)
    discrete_targets_agree_with_comfyui(small_sdxl, prediction, inputs, cross_attn=cond, pooled_output=pooled)


def test_lora_gradients_match_finite_differences_of_comfyui_forward(small_sdxl):
    a = small_sdxl
    dm = a.diffusion_model
    names = injection.inject(dm, injection.AdapterSpec(rank=4, alpha=4.0, dtype=torch.float64), a.lora_block_prefixes)
    assert "input_blocks.4.1.proj_in" in names and "output_blocks.5.1.transformer_blocks.0.ff.net.2" in names
    assert "middle_block.1.transformer_blocks.0.attn2.to_v" in names
    assert not [n for n in names if "emb_layers" in n]  # ResBlocks stay untouched
    linears = {n for n, m in dm.named_modules() if isinstance(m, torch.nn.Linear) and ".1." in n
               and n.split(".")[-1] not in ("lora_A", "lora_B") and "emb_layers" not in n}
    assert set(names) == linears  # every linear of every SpatialTransformer
    give_lora_b_values(dm)
    lora_gradients_match_finite_differences(a, _inputs())


def test_every_layer_boundary_can_be_a_deepspeed_stage_boundary(small_sdxl):
    """Every layer boundary can be where DeepSpeed cuts the pipeline (see layer_checks)."""
    a = small_sdxl
    dm = a.diffusion_model
    if not list(injection.adapted_modules(dm)):
        injection.inject(dm, injection.AdapterSpec(rank=2, alpha=2.0, dtype=torch.float64), a.lora_block_prefixes)
        give_lora_b_values(dm)
    every_boundary_is_a_stage_boundary(a, _inputs())


def test_captions_of_different_lengths_batch_like_comfyui(small_sdxl):
    """A 2-chunk caption batched with a 1-chunk one gives each sample its own unbatched output."""
    a = small_sdxl
    x0, noise, t, _, pooled = _inputs()
    short, long = torch.randn(3, CONTEXT_DIM, dtype=torch.float64), torch.randn(6, CONTEXT_DIM, dtype=torch.float64)
    cond, pooled_b = a.collate_text([{"cond": short, "pooled": pooled[0]}, {"cond": long, "pooled": pooled[1]}])
    assert cond.shape == (2, 6, CONTEXT_DIM)
    with torch.no_grad():
        layers = a.to_layers()
        batched = _run_layers(layers, (x0, noise, t, cond, pooled_b))
        for i, c in enumerate((short, long)):
            alone = _run_layers(layers, (x0[i:i + 1], noise[i:i + 1], t[i:i + 1], c[None], pooled[i:i + 1]))
            assert torch.allclose(batched[i:i + 1], alone, atol=1e-10, rtol=1e-8)
