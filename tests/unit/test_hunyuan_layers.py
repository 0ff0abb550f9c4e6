"""HunyuanVideo, HunyuanVideo 1.5 and HunyuanImage 2.1 pipeline layers against ComfyUI's HunyuanVideo model:
the same output as its forward (captions of different lengths padded in one micro-batch, so the masking is
exercised), LoRA gradients equal to finite differences of that forward, training targets ComfyUI's flow
sampling turns back into the clean latent, and tuples DeepSpeed's pipeline can cut anywhere; plus ComfyUI's
detection of the real layouts and the tiny files through ComfyUI's loaders."""
import pytest
import torch
from layer_checks import (comfy_model, every_boundary_is_a_stage_boundary_with_lora, give_lora_b_values,
                          layers_match_comfyui_forward, lora_gradients_match_finite_differences, run_layers)

from pipetrain.backend.adapters import injection
from pipetrain.backend.config import ModelConfig
from pipetrain.backend.host.runtime import ensure_comfyui

ensure_comfyui()
TEXT = 24          # the LLM's width (4096 / 3584 for real)
ARCHS = ("hunyuan_video", "hunyuan_video_15", "hunyuan_image_21")
COMFY_CLASS = {"hunyuan_video": "HunyuanVideo", "hunyuan_video_15": "HunyuanVideo15",
               "hunyuan_image_21": "HunyuanImage21"}


def _small_config(arch):
    """Width 64 (2 heads of 32), 2 double + 2 single blocks (HunyuanVideo 1.5: 2 double, none single)."""
    from pipetrain.backend.models import hunyuan_video as hv

    configs = {"hunyuan_video": hv.HV_CONFIGS, "hunyuan_video_15": hv.HV15_CONFIGS,
               "hunyuan_image_21": hv.HI21_CONFIGS}[arch]
    axes = [16, 16] if arch == "hunyuan_image_21" else [8, 12, 12]
    return {**configs["tiny"], "hidden_size": 64, "num_heads": 2, "axes_dim": axes, "context_in_dim": TEXT}


@pytest.fixture(scope="module", params=ARCHS)
def small(request):
    """ComfyUI's own ``model_base`` model of each architecture in float64 with a small config."""
    from pipetrain.backend.models.registry import adapter_class

    arch = request.param
    adapter = adapter_class(arch)(ModelConfig(type=arch, diffusion_model="unused", vae="unused", guidance=3.5))
    adapter.dtype = torch.float64
    adapter.use_model(comfy_model(arch, _small_config(arch), std=0.08))
    return adapter


def _inputs(adapter, batch=2, seed=1):
    """Two samples whose captions differ in length (and, with glyph tokens, one quoting nothing); video
    latents of 3 frames (a 9-frame clip); odd patch counts where the patch is 2."""
    g = torch.Generator().manual_seed(seed)
    channels = adapter.channels
    size = (6, 10) if not adapter.video else (3, 6, 10)
    x0 = torch.randn(batch, channels, *size, generator=g, dtype=torch.float64)
    noise = torch.randn(x0.shape, generator=g, dtype=torch.float64)
    t = torch.tensor([0.25, 0.8, 0.05][:batch], dtype=torch.float64)
    tokens = torch.tensor([7, 4, 5][:batch])
    text = torch.randn(batch, int(tokens.max()), TEXT, generator=g, dtype=torch.float64)
    text[torch.arange(text.shape[1])[None] >= tokens[:, None]] = 0   # zero padding, as collate_text pads
    if adapter.text_fields[1] == "pooled":
        return x0, noise, t, text, torch.randn(batch, 768, generator=g, dtype=torch.float64), tokens[:, None]
    glyphs = torch.tensor([3, 0, 2][:batch])
    glyph = torch.randn(batch, int(glyphs.max()), 1472, generator=g, dtype=torch.float64)
    glyph[torch.arange(glyph.shape[1])[None] >= glyphs[:, None]] = 0
    return x0, noise, t, text, glyph, torch.stack((tokens, glyphs), 1)


@pytest.mark.parametrize("arch", ARCHS)
def test_comfyui_detects_the_tiny_and_full_layouts(arch):
    import comfy.model_detection
    import comfy.supported_models

    from pipetrain.backend.models import loading, tiny
    from pipetrain.backend.models.registry import arch_spec

    for size in ("tiny", "full"):
        sd = {k: torch.empty(s, device="meta") for k, s, _ in tiny.tensor_plan(tiny.build_diffusion_model(arch, size))}
        assert type(comfy.model_detection.model_config_from_unet(sd, "")) is getattr(comfy.supported_models,
                                                                                     COMFY_CLASS[arch])
        assert comfy.model_detection.detect_unet_config(sd, "") == arch_spec(arch).unet_config(size)
        assert loading.arch_from_state_dict_shapes({k: v.shape for k, v in sd.items()}) == arch


def test_tiny_hunyuan_video_files_load_through_comfyui(model_files):
    """The diffusion model and the causal 3D VAE through ComfyUI's detection (the narrow VAE's widths from its
    metadata); LLaMA + CLIP-L through their metadata, ComfyUI's chat template cut off the LLaMA tokens."""
    from pipetrain.backend.models import loading
    from pipetrain.backend.models.registry import adapter_class

    files = model_files("hunyuan_video")
    patcher = loading.load_diffusion_model(files.diffusion_model, torch.float32)
    assert type(patcher.model).__name__ == "HunyuanVideo" and patcher.model.diffusion_model.hidden_size == 256
    vae = loading.load_vae(files.vae, arch="hunyuan_video")
    assert type(vae.first_stage_model).__name__ == "AutoencoderKL" and vae.latent_dim == 3
    assert vae.encode(torch.rand(9, 32, 48, 3)).shape == (1, 16, 3, 4, 6)   # 9 frames -> 3 latent frames
    with pytest.raises(Exception, match="latent channels|encodes videos"):
        loading.load_vae(model_files("chroma").vae, arch="hunyuan_video")   # Flux's 16-channel image VAE
    clip = loading.load_text_encoders(files.text_encoders, "hunyuan_video", torch.float32)
    adapter = adapter_class("hunyuan_video")(ModelConfig(type="hunyuan_video", diffusion_model="-", vae="-"))
    short, long = (adapter.encode_caption(clip, c) for c in ("a cube", "a red cube slides to the left quickly"))
    assert short["llama"].shape[1] == 64 and short["pooled"].shape == (768,)
    assert 2 <= short["llama"].shape[0] < long["llama"].shape[0] < 20     # the template's 95 tokens are gone
    llama, pooled, lengths = adapter.collate_text([short, long])
    assert lengths[:, 0].tolist() == [short["llama"].shape[0], long["llama"].shape[0]]


@pytest.mark.parametrize("arch", ["hunyuan_video_15", "hunyuan_image_21"])
def test_tiny_qwen_byt5_files_load_through_comfyui(model_files, arch):
    """HunyuanVideo 1.5 / HunyuanImage 2.1: the diffusion model and the narrow VAE through ComfyUI's detection;
    Qwen2.5-VL + byT5 through their metadata: glyph tokens only for the quoted text of a caption."""
    from pipetrain.backend.models import loading
    from pipetrain.backend.models.registry import adapter_class

    files = model_files(arch)
    patcher = loading.load_diffusion_model(files.diffusion_model, torch.float32)
    assert type(patcher.model).__name__ == COMFY_CLASS[arch] and patcher.model.diffusion_model.hidden_size == 256
    vae = loading.load_vae(files.vae, arch=arch)
    if arch == "hunyuan_video_15":   # 16x spatial, 4x temporal
        assert vae.encode(torch.rand(9, 32, 48, 3)).shape == (1, 32, 3, 2, 3)
    else:                            # 32x spatial, images
        assert vae.encode(torch.rand(1, 64, 96, 3)).shape == (1, 64, 2, 3)
    clip = loading.load_text_encoders(files.text_encoders, arch, torch.float32)
    adapter = adapter_class(arch)(ModelConfig(type=arch, diffusion_model="-", vae="-"))
    plain, quoting = (adapter.encode_caption(clip, c) for c in ("a shop front", 'a shop sign reading "OPEN"'))
    assert plain["qwen"].shape[1] == 64 and plain["byt5"].shape == (0, 1472)
    assert quoting["byt5"].shape[0] > 0 and quoting["byt5"].shape[1] == 1472
    qwen, glyph, lengths = adapter.collate_text([plain, quoting])
    assert lengths.tolist() == [[plain["qwen"].shape[0], 0], [quoting["qwen"].shape[0], quoting["byt5"].shape[0]]]
    assert glyph.shape == (2, quoting["byt5"].shape[0], 1472) and glyph[0].abs().sum() == 0
    cond = adapter.sample_conditioning(plain, 1.0)[0]
    assert cond[0].shape == (1, plain["qwen"].shape[0], 64) and "conditioning_byt5small" not in cond[1]


def test_layers_match_comfyui_forward(small):
    a = small
    layers_match_comfyui_forward(a, _inputs(a))


def test_training_targets_agree_with_comfyui_flow_sampling(small):
    """ComfyUI's sampling shift is the default; one sample, as ComfyUI's apply_model runs a conditioning."""
    a = small
    model, objective = a.patcher.model, a.objective()
    ms = model.model_sampling
    assert objective.multiplier == ms.multiplier == 1000.0 and objective.shift == ms.shift
    x0, noise, t, *text = inputs = [x[:1] for x in _inputs(a)]
    x_comfy = ms.noise_scaling(t, noise, x0)
    assert torch.allclose(ms.calculate_input(t, x_comfy), objective.noisy(x0, noise, t))
    assert torch.allclose(ms.calculate_denoised(t, objective.target(x0, noise, t), x_comfy), x0)
    cond = {"c_crossattn": text[0][:, :int(text[-1][0, 0])]}
    if a.text_fields[1] == "pooled":
        cond.update(y=text[1], guidance=torch.tensor([a.cfg.guidance]))
    else:
        cond.update(txt_byt5=text[1][:, :int(text[-1][0, 1])], disable_time_r=True)
    extra = a.diffusion_model.img_in.proj.weight.shape[1] - x0.shape[1]
    if extra:   # HunyuanVideo 1.5's i2v inputs, zeros for t2v as its concat_cond makes them
        cond["c_concat"] = x0.new_zeros(1, extra, *x0.shape[2:])
    with torch.no_grad():
        comfy_denoised = model.apply_model(x_comfy, t, **cond)
        ours = ms.calculate_denoised(t, run_layers(a.to_layers(), inputs), x_comfy)
    assert (comfy_denoised - ours).abs().max() / ours.abs().max() < 1e-6


def test_lora_gradients_match_finite_differences_of_comfyui_forward(small):
    a = small
    dm = a.diffusion_model
    names = injection.inject(dm, injection.AdapterSpec(rank=4, alpha=4.0, dtype=torch.float64), a.lora_block_prefixes)
    dead = 0 if len(dm.single_blocks) else 3   # no single blocks: the last text projection and MLP reach nothing
    assert len(names) == 10 * len(dm.double_blocks) + 3 * len(dm.single_blocks) - dead
    assert "double_blocks.1.txt_mod.lin" in names and "double_blocks.0.img_mlp.2" in names
    give_lora_b_values(dm)
    lora_gradients_match_finite_differences(a, _inputs(a), eps=1e-4)   # ComfyUI's RoPE runs in float32


def test_every_layer_boundary_can_be_a_deepspeed_stage_boundary(small):
    a = small
    every_boundary_is_a_stage_boundary_with_lora(a, _inputs(a))
