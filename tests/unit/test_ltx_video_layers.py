"""LTX-Video pipeline layers against ComfyUI's LTXVModel on 5-D video latents: the same output as its forward
(its in-place residuals re-stated out of place), captions of different lengths masked as ComfyUI masks T5's
padding, LoRA gradients equal to finite differences of that forward, training targets and LTX's
resolution-dependent shift as ComfyUI's model_sampling has them, and tuples DeepSpeed's pipeline can cut
anywhere; plus the real-layout files."""
import math

import pytest
import torch
from layer_checks import (every_boundary_is_a_stage_boundary_with_lora, give_lora_b_values,
                          layers_match_comfyui_forward, lora_gradients_match_finite_differences,
                          padded_caption_inputs, run_layers, small_adapter)

from pipetrain.backend.adapters import injection
from pipetrain.backend.config import ModelConfig
from pipetrain.backend.host.runtime import comfy_nodes, ensure_comfyui

ensure_comfyui()
TEXT = 48   # T5-XXL's width is 4096


@pytest.fixture(scope="module")
def small_ltx():
    """ComfyUI's own ``model_base.LTXV`` in float64: width 32 (4 heads of 8), 2 blocks, 128 latent channels."""
    from pipetrain.backend.models.ltx_video import LTXVideoAdapter, ltx_config

    config = {**ltx_config(2, 8), "num_attention_heads": 4, "cross_attention_dim": 32, "caption_channels": TEXT}
    return small_adapter(LTXVideoAdapter, "ltx_video", config, std=0.08)


def _inputs(batch=2, size=(3, 4, 6), tokens=(7, 4), seed=1):
    """3 latent frames (a 17-frame clip) of 4 x 6; the second caption is shorter (zero-padded)."""
    return padded_caption_inputs(128, size, tokens, TEXT, batch, seed)[0]


def test_comfyui_detects_the_tiny_and_full_layouts_as_ltxv():
    import comfy.model_detection
    import comfy.supported_models

    from pipetrain.backend.models import loading, tiny
    from pipetrain.backend.models.ltx_video import LTX_CONFIGS

    for size in ("tiny", "full"):
        module = tiny.build_diffusion_model("ltx_video", size)
        sd = {k: torch.empty(s, device="meta") for k, s, _ in tiny.tensor_plan(module)}
        assert type(comfy.model_detection.model_config_from_unet(sd, "")) is comfy.supported_models.LTXV
        assert comfy.model_detection.detect_unet_config(sd, "") == LTX_CONFIGS[size]
        assert loading.arch_from_state_dict_shapes({k: v.shape for k, v in sd.items()}) == "ltx_video"
    full = tiny.build_diffusion_model("ltx_video", "full")
    assert 1.8e9 < sum(p.numel() for p in full.parameters()) < 2.2e9   # LTX-Video 2B


def test_the_full_ltx_vae_layout_is_what_comfyui_builds():
    import comfy.sd

    from pipetrain.backend.models import tiny
    module = tiny.build_vae("ltx_video", "full")
    sd = {k: torch.empty(s, device="meta") for k, s, _ in tiny.tensor_plan(module)}
    assert "encoder.down_blocks.1.conv.conv.bias" in sd and "decoder.up_blocks.0.res_blocks.0.conv1.conv.weight" in sd
    assert sd["decoder.up_blocks.0.res_blocks.0.conv1.conv.weight"].shape[0] == 1024   # ComfyUI's "version 2"
    with torch.device("meta"):
        vae = comfy.sd.VAE(sd=sd)
    assert vae.latent_channels == 128 and vae.downscale_index_formula == (8, 32, 32)


def test_tiny_ltx_files_load_through_comfyui(model_files):
    """The diffusion model through ComfyUI's detection; the VAE through ComfyUI's reading of the block layout
    in the file's "config" metadata; T5-XXL through its metadata. ComfyUI's LTXV T5 pads to 128 tokens and
    returns the mask; the cached caption is its own tokens."""
    from pipetrain.backend.models import loading
    from pipetrain.backend.models.ltx_video import LTXVideoAdapter

    files = model_files("ltx_video")
    patcher = loading.load_diffusion_model(files.diffusion_model, torch.float32)
    assert type(patcher.model).__name__ == "LTXV" and patcher.model.diffusion_model.inner_dim == 256
    vae = loading.load_vae(files.vae, arch="ltx_video")
    assert type(vae.first_stage_model).__name__ == "VideoVAE"
    latent = vae.encode(torch.rand(9, 64, 96, 3))
    assert latent.shape == (1, 128, 2, 2, 3)                                  # 9 frames -> 2 latent frames
    assert latent.abs().max() < 100                                           # latent statistics: mean 0, std 1
    with pytest.raises(Exception, match="128 latent channels"):
        loading.load_vae(model_files("wan").vae, arch="ltx_video")
    clip = loading.load_text_encoders(files.text_encoders, "ltx_video", torch.float32)
    out = clip.encode_from_tokens(clip.tokenize("a red cube slides left"), return_dict=True)
    assert out["cond"].shape == (1, 128, 4096) and out["attention_mask"].shape == (1, 128)
    adapter = LTXVideoAdapter(ModelConfig(type="ltx_video", diffusion_model="unused", vae="unused"))
    cached = adapter.encode_caption(clip, "a red cube slides left")["cond"]
    n = int(out["attention_mask"].sum())
    assert 3 < n < 20 and cached.shape == (n, 4096) and torch.equal(cached, out["cond"][0, :n])


def test_layers_match_comfyui_forward(small_ltx):
    a = small_ltx
    x0, noise, t, *text = inputs = _inputs()
    ours = layers_match_comfyui_forward(a, inputs)
    with torch.no_grad():
        # the shorter caption alone, unpadded: what ComfyUI computes for it (masking is exact)
        alone = a.reference_forward(a.objective().noisy(x0, noise, t)[1:], t[1:], [text[0][1:, :4], text[1][1:]])
    assert torch.allclose(ours[1:], alone, atol=1e-10, rtol=1e-8)


def test_training_targets_agree_with_comfyui_flow_sampling(small_ltx):
    a = small_ltx
    model, objective = a.patcher.model, a.objective()
    ms = model.model_sampling
    assert type(ms).__mro__[1].__name__ == "ModelSamplingFlux" and objective.multiplier == 1.0
    x0, noise, t, context, lengths = inputs = _inputs(tokens=(7, 7))
    x_comfy = ms.noise_scaling(t, noise, x0)
    assert torch.allclose(ms.calculate_input(t, x_comfy), objective.noisy(x0, noise, t))
    assert torch.equal(ms.timestep(t), objective.model_timestep(t))
    assert torch.allclose(ms.calculate_denoised(t, objective.target(x0, noise, t), x_comfy), x0)
    with torch.no_grad():
        mask = torch.ones(context.shape[:2], dtype=torch.long)    # what ComfyUI's LTXV T5 hands over
        comfy_denoised = model.apply_model(x_comfy, t, c_crossattn=context, attention_mask=mask)
        ours = ms.calculate_denoised(t, run_layers(a.to_layers(), inputs), x_comfy)
    assert (comfy_denoised - ours).abs().max() / ours.abs().max() < 1e-6


def test_timesteps_take_the_shift_comfyui_samples_ltx_with_at_that_resolution(small_ltx):
    """ComfyUI's ModelSamplingLTXV (max_shift 2.05, base_shift 0.95, this latent) gives sigma(t) for each t;
    training draws logit-normal t shifted the same way, from the latent's T x H x W tokens."""
    comfy_nodes()   # ComfyUI's own ``nodes``, which nodes_lt imports (``python -m pytest`` puts our nodes/ first)
    from comfy_extras.nodes_lt import ModelSamplingLTXV

    a = small_ltx
    t = torch.linspace(0.02, 0.98, 9)
    for shape in [(128, 1, 16, 16), (128, 3, 16, 24), (128, 5, 32, 32)]:
        latent = torch.zeros(1, *shape)
        (patched,) = ModelSamplingLTXV.execute(a.patcher, 2.05, 0.95, {"samples": latent}).result
        comfy_sigma = patched.get_model_object("model_sampling").sigma(t)
        assert a.seq_len(latent[0]) == math.prod(shape[1:])
        assert torch.allclose(a.objective()._shift(t, a.seq_len(latent[0])), comfy_sigma, atol=1e-6)
    objective = a.objective()
    g = torch.Generator().manual_seed(0)
    drawn = torch.cat([objective.sample_t(1, 4096, g) for _ in range(2000)])
    assert abs(float(drawn.median()) - float(objective.quantile_t(0.5, 4096))) < 0.02
    assert float(objective.quantile_t(0.5, 4096)) == pytest.approx(1 / (1 + math.exp(-2.05)), abs=1e-6)
    a.cfg.shift = 3.0    # a constant shift from [model] replaces it
    try:
        assert float(a.objective().quantile_t(0.5, 4096)) == pytest.approx(0.75)
    finally:
        a.cfg.shift = None


def test_lora_gradients_match_finite_differences_of_comfyui_forward(small_ltx):
    a = small_ltx
    dm = a.diffusion_model
    names = injection.inject(dm, injection.AdapterSpec(rank=4, alpha=4.0, dtype=torch.float64), a.lora_block_prefixes)
    assert len(names) == 2 * 10 and "transformer_blocks.1.attn2.to_v" in names
    assert "transformer_blocks.0.ff.net.0.proj" in names and "transformer_blocks.0.attn1.to_out.0" in names
    give_lora_b_values(dm)
    lora_gradients_match_finite_differences(a, _inputs(), eps=1e-5)


def test_every_layer_boundary_can_be_a_deepspeed_stage_boundary(small_ltx):
    a = small_ltx
    every_boundary_is_a_stage_boundary_with_lora(a, _inputs())


# --- image to video (ltx_video_i2v) ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_ltx_i2v():
    from pipetrain.backend.models.ltx_video import LTXVideoI2VAdapter, ltx_config

    config = {**ltx_config(2, 8), "num_attention_heads": 4, "cross_attention_dim": 32, "caption_channels": TEXT}
    return small_adapter(LTXVideoI2VAdapter, "ltx_video", config, std=0.08, model_type="ltx_video_i2v")


def _i2v_inputs(seed=1):
    """``_inputs`` and a given first latent frame that is not the clip's own (so that using it shows)."""
    (x0, noise, t, cond, lengths), g = padded_caption_inputs(128, (3, 4, 6), (7, 4), TEXT, 2, seed)
    return x0, noise, t, cond, lengths, torch.randn(2, 128, 1, 4, 6, generator=g, dtype=torch.float64)


class _GivenLatentVAE:
    """What LTXVImgToVideo reads of a VAE: ``encode`` of the image (here, a latent given by the test)."""
    def __init__(self, latent):
        self.latent = latent

    def encode(self, pixels):
        return self.latent


def test_i2v_layers_match_comfyui_under_ltxv_img_to_video(small_ltx_i2v):
    """ComfyUI's sampling step under LTXVImgToVideo's output (strength 1): its noise mask through the sampler's
    reshape, the given latent put over the first frame (KSamplerX0Inpaint), the mask as ``denoise_mask`` (one
    timestep per token, 0 on the first frame) -- the layers compute the same prediction."""
    comfy_nodes()
    import comfy.utils
    from comfy_extras.nodes_lt import LTXVImgToVideo

    a = small_ltx_i2v
    assert a.conditioning_fields == ("first_frame",)
    x0, noise, t, cond, lengths, first = inputs = _i2v_inputs()
    layers_match_comfyui_forward(a, inputs)
    samples, masks = [], []
    for i in range(2):   # one node per sample: each clip has its own first frame
        _, _, latent = LTXVImgToVideo.execute([], [], torch.zeros(1, 128, 192, 3), _GivenLatentVAE(first[i:i + 1]),
                                              192, 128, 17, 1, 1.0).args
        samples.append(latent["samples"])
        masks.append(latent["noise_mask"])
    latent_image, noise_mask = torch.cat(samples).double(), torch.cat(masks).double()
    assert latent_image.shape == x0.shape and noise_mask[:, 0, :, 0, 0].tolist() == [[0, 1, 1]] * 2
    model = a.patcher.model
    ms = model.model_sampling
    mask = comfy.utils.reshape_mask(noise_mask, x0.shape)
    x_in = ms.noise_scaling(t, noise, x0) * mask + latent_image * (1 - mask)
    caption_mask = (torch.arange(cond.shape[1])[None] < lengths[:, None]).long()
    with torch.no_grad():
        comfy_denoised = model.apply_model(x_in, t, c_crossattn=cond, attention_mask=caption_mask, denoise_mask=mask)
        ours = ms.calculate_denoised(t, run_layers(a.to_layers(), inputs), x_in)
    assert (comfy_denoised - ours).abs().max() / ours.abs().max() < 1e-6   # apply_model's timesteps are float32
    # the given frame is used: another one changes the other frames' prediction
    other = (*inputs[:5], first + 1)
    with torch.no_grad():
        assert not torch.allclose(run_layers(a.to_layers(), other)[:, :, 1:], ours[:, :, 1:])


def test_i2v_loss_leaves_out_the_given_first_frame(small_ltx_i2v):
    a = small_ltx_i2v
    x0, noise, t, *_ = _i2v_inputs()
    target = a.objective().target(x0, noise, t)
    assert torch.allclose(a.loss(torch.zeros_like(x0), (x0, noise, t)), (target[:, :, 1:] ** 2).mean())
    assert not torch.allclose(a.loss(torch.zeros_like(x0), (x0, noise, t)), (target ** 2).mean())


def test_i2v_lora_gradients_and_stage_boundaries(small_ltx_i2v):
    a = small_ltx_i2v
    dm = a.diffusion_model
    injection.inject(dm, injection.AdapterSpec(rank=4, alpha=4.0, dtype=torch.float64), a.lora_block_prefixes)
    give_lora_b_values(dm)
    lora_gradients_match_finite_differences(a, _i2v_inputs(), eps=1e-5)
    every_boundary_is_a_stage_boundary_with_lora(a, _i2v_inputs())


def test_i2v_first_frame_is_what_ltxv_img_to_video_encodes(model_files):
    """The cached ``first_frame``: the clip's first frame encoded alone by LTX's VAE, the latent ComfyUI's node
    puts in the first frame; later frames change nothing; still images are refused."""
    comfy_nodes()
    from comfy_extras.nodes_lt import LTXVImgToVideo

    from pipetrain.backend.models import loading
    from pipetrain.backend.models.ltx_video import LTXVideoI2VAdapter

    a = LTXVideoI2VAdapter(ModelConfig(type="ltx_video_i2v", diffusion_model="unused", vae="unused"))
    vae = loading.load_vae(model_files("ltx_video").vae, arch="ltx_video")
    clip = torch.rand(9, 64, 96, 3, generator=torch.Generator().manual_seed(0))
    first = a.encode_conditioning(vae, clip, None)["first_frame"]
    _, _, latent = LTXVImgToVideo.execute([], [], clip[:1], vae, 96, 64, 9, 1, 1.0).args
    assert first.shape == (128, 1, 2, 3) and torch.allclose(first, latent["samples"][0, :, :1], atol=1e-6)
    later = clip.clone()
    later[5] = 1 - later[5]
    assert torch.equal(a.encode_conditioning(vae, later, None)["first_frame"], first)
    with pytest.raises(Exception, match="videos only"):
        a.encode_conditioning(vae, clip[:1], None)
