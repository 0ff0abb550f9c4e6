"""Wan variants beyond 2.1 t2v against ComfyUI: Wan 2.2 TI2V 5B (t2v, and its ti2v mode with the first frame
given at timestep 0), Wan 2.1 i2v 14B (mask + image latent channels, CLIP-vision tokens), Wan 2.1 flf2v 14B
(the same with both frames' CLIP-vision tokens and their position embedding) and Wan 2.2 i2v 14B
(mask + image latent channels): the same output as ComfyUI's forward, LoRA gradients equal to finite differences
of that forward, training targets ComfyUI's model turns back into the clean latent, every layer boundary a
possible stage boundary; ComfyUI's detection of each layout; the Wan 2.2 VAE's tiny file; min_t / max_t."""
import pytest
import torch
from layer_checks import (comfy_model, every_boundary_is_a_stage_boundary_with_lora, give_lora_b_values,
                          layers_match_comfyui_forward, lora_gradients_match_finite_differences, run_layers)

from pipetrain.backend.adapters import injection
from pipetrain.backend.config import ModelConfig
from pipetrain.backend.host.runtime import ensure_comfyui

ensure_comfyui()
TEXT = 48   # UMT5-XXL's width is 4096

# variant -> (type, small unet_config kwargs for wan_config, conditioning maker)
VARIANTS = {
    "5b_t2v": ("wan22_5b", dict(in_dim=48, out_dim=48)),
    "5b_ti2v": ("wan22_5b_i2v", dict(in_dim=48, out_dim=48)),
    "i2v_21": ("wan_i2v", dict(in_dim=36, model_type="i2v")),
    "i2v_21_noclip": ("wan_i2v", dict(in_dim=36, model_type="i2v")),
    "i2v_22": ("wan_i2v", dict(in_dim=36)),
    "flf2v": ("wan_flf2v", dict(in_dim=36, model_type="i2v")),
}


def _adapter(variant):
    from pipetrain.backend.models.registry import adapter_class
    from pipetrain.backend.models.wan import wan_config

    arch, kwargs = VARIANTS[variant]
    clip_vision = "clip_vision_h.safetensors" if variant in ("i2v_21", "flf2v") else None
    config = {**wan_config(64, 96, 2, **kwargs), "num_heads": 2, "text_dim": TEXT, "freq_dim": 32}
    if arch == "wan_flf2v":   # img_emb.emb_pos over the two frames' tokens
        config["flf_pos_embed_token_number"] = 514
    adapter = adapter_class(arch)(ModelConfig(type=arch, diffusion_model="unused", vae="unused",
                                              clip_vision=clip_vision))
    adapter.dtype = torch.float64
    adapter.use_model(comfy_model(arch, config, std=0.08))
    return adapter


@pytest.fixture(scope="module", params=list(VARIANTS))
def small(request):
    return request.param, _adapter(request.param)


def _inputs(adapter, batch=2, size=(3, 6, 10), tokens=7, seed=1):
    """3 latent frames of 6 x 10 (odd patch counts on purpose), then the text, then the conditioning."""
    g = torch.Generator().manual_seed(seed)
    c = adapter.latent_channels
    x0 = torch.randn(batch, c, *size, generator=g, dtype=torch.float64)
    noise = torch.randn(x0.shape, generator=g, dtype=torch.float64)
    t = torch.tensor([0.25, 0.8, 0.05][:batch], dtype=torch.float64)
    cond = {"first_frame": x0[:, :, :1].clone(),
            "concat": torch.randn(batch, 20, *size, generator=g, dtype=torch.float64),
            "clip_fea": torch.randn(batch, 514 if adapter.arch == "wan_flf2v" else 257, 1280, generator=g,
                                    dtype=torch.float64)}
    text = torch.randn(batch, tokens, TEXT, generator=g, dtype=torch.float64)
    return (x0, noise, t, text, *(cond[name] for name in adapter.conditioning_fields))


def _comfy_apply(adapter, x_comfy, t, text, conditioning):
    """ComfyUI's ``model_base`` apply_model with the conds its Wan nodes set up."""
    cond = dict(zip(adapter.conditioning_fields, conditioning))
    kwargs = {}
    if "concat" in cond:
        kwargs["c_concat"] = cond["concat"]
    if "clip_fea" in cond:
        kwargs["clip_fea"] = cond["clip_fea"]
    if "first_frame" in cond:   # Wan22ImageToVideoLatent: noise_mask 0 on the given frame, which KSampler keeps
        mask = torch.ones(x_comfy.shape[0], 1, *x_comfy.shape[2:], dtype=x_comfy.dtype)
        mask[:, :, 0] = 0
        x_comfy = torch.cat([cond["first_frame"], x_comfy[:, :, 1:]], dim=2)
        kwargs["denoise_mask"] = mask
    return adapter.patcher.model.apply_model(x_comfy, t, c_crossattn=text, **kwargs)


def test_comfyui_detects_each_layout_as_its_type():
    import comfy.model_detection
    import comfy.supported_models as sm

    from pipetrain.backend.models import loading, tiny
    from pipetrain.backend.models.wan import WAN_FLF2V_CONFIGS, WAN_I2V_CONFIGS, build_wan
    from pipetrain.backend.models.wan22 import WAN22_5B_CONFIGS

    cases = [(WAN22_5B_CONFIGS[s], sm.WAN22_T2V, "wan22_5b") for s in ("tiny", "full")]
    cases += [(WAN_I2V_CONFIGS[s], sm.WAN21_I2V, "wan_i2v") for s in ("tiny", "full")]
    cases += [(WAN_I2V_CONFIGS[s], sm.WAN21_T2V, "wan_i2v") for s in ("tiny_22", "full_22")]
    cases += [(WAN_FLF2V_CONFIGS[s], sm.WAN21_I2V, "wan_flf2v") for s in ("tiny", "full")]
    for config, comfy_class, arch in cases:
        sd = {k: torch.empty(s, device="meta") for k, s, _ in tiny.tensor_plan(build_wan(config))}
        assert type(comfy.model_detection.model_config_from_unet(sd, "")) is comfy_class
        detected = comfy.model_detection.detect_unet_config(sd, "")
        assert {k: detected[k] for k in config} == config
        assert loading.arch_from_state_dict_shapes({k: v.shape for k, v in sd.items()}) == arch
    sd = {k: torch.empty(s, device="meta") for k, s, _ in tiny.tensor_plan(tiny.build_diffusion_model("wan", "tiny"))}
    assert loading.arch_from_state_dict_shapes({k: v.shape for k, v in sd.items()}) == "wan"   # t2v stays wan


def test_tiny_wan22_files_load_through_comfyui(model_files):
    """The 5B and its narrowed Wan 2.2 VAE through ComfyUI's detection (the VAE's widths from the metadata):
    16x spatial, 4x temporal, 48 channels."""
    from pipetrain.backend.models import loading

    files = model_files("wan22_5b")
    patcher = loading.load_diffusion_model(files.diffusion_model, torch.float32)
    assert type(patcher.model).__name__ == "WAN22" and patcher.model.diffusion_model.in_dim == 48
    vae = loading.load_vae(files.vae, arch="wan22_5b")
    assert type(vae.first_stage_model).__module__ == "comfy.ldm.wan.vae2_2" and vae.first_stage_model.dim == 16
    clip = torch.rand(9, 64, 96, 3)
    latent = vae.encode(clip)
    assert latent.shape == (1, 48, 3, 4, 6)
    assert torch.equal(vae.encode(clip[:1])[:, :, 0], latent[:, :, 0])   # the first latent frame: frame 0 alone
    assert type(loading.load_vae(model_files("wan").vae).first_stage_model).__module__ == "comfy.ldm.wan.vae"
    with pytest.raises(Exception, match="48 latent channels"):
        loading.load_vae(model_files("wan").vae, arch="wan22_5b")


def test_layers_match_comfyui_forward(small):
    variant, a = small
    layers_match_comfyui_forward(a, _inputs(a))


def test_training_targets_agree_with_comfyui_model(small):
    variant, a = small
    model, objective = a.patcher.model, a.objective()
    ms = model.model_sampling
    assert objective.multiplier == ms.multiplier == 1000.0
    x0, noise, t, text, *conditioning = inputs = _inputs(a)
    x_comfy = ms.noise_scaling(t, noise, x0)
    assert torch.allclose(ms.calculate_denoised(t, objective.target(x0, noise, t), x_comfy), x0)
    with torch.no_grad():
        comfy_denoised = _comfy_apply(a, x_comfy, t, text, conditioning)
        ours = ms.calculate_denoised(t, run_layers(a.to_layers(), inputs), x_comfy)
    frames = slice(1, None) if variant == "5b_ti2v" else slice(None)   # ComfyUI keeps the given first frame
    assert (comfy_denoised - ours)[:, :, frames].abs().max() / ours.abs().max() < 1e-6


def test_lora_gradients_match_finite_differences_of_comfyui_forward(small):
    variant, a = small
    dm = a.diffusion_model
    names = injection.inject(dm, injection.AdapterSpec(rank=4, alpha=4.0, dtype=torch.float64), a.lora_block_prefixes)
    per_block = 12 if variant.startswith("i2v_21") or variant == "flf2v" else 10   # Wan 2.1 i2v: + k_img, v_img
    assert len(names) == 2 * per_block and "blocks.1.cross_attn.v" in names
    give_lora_b_values(dm)
    if variant == "i2v_21_noclip":   # img_emb's k_img/v_img then see the text: every LoRA still gets a gradient
        assert "blocks.0.cross_attn.k_img" in names
    lora_gradients_match_finite_differences(a, _inputs(a), eps=1e-4)   # ComfyUI's RoPE runs in float32


def test_every_layer_boundary_can_be_a_deepspeed_stage_boundary(small):
    variant, a = small
    every_boundary_is_a_stage_boundary_with_lora(a, _inputs(a))


def test_ti2v_loss_leaves_out_the_given_first_frame():
    a = _adapter("5b_ti2v")
    x0, noise, t, *_ = _inputs(a)
    pred = torch.zeros_like(x0)
    target = a.objective().target(x0, noise, t)
    assert torch.allclose(a.loss(pred, (x0, noise, t)), (target[:, :, 1:] ** 2).mean())


def test_i2v_conditioning_is_the_first_frame(model_files):
    """``concat`` = mask (1 on the first latent frame) + the latent of [first frame, mid-grey frames], as
    ComfyUI's WanImageToVideo builds it; changing a later frame changes nothing, the first frame changes it."""
    from pipetrain.backend.models import loading
    from pipetrain.backend.models.wan import WanI2VAdapter

    a = WanI2VAdapter(ModelConfig(type="wan_i2v", diffusion_model="unused", vae="unused"))
    vae = loading.load_vae(model_files("wan").vae)
    g = torch.Generator().manual_seed(0)
    clip = torch.rand(9, 32, 48, 3, generator=g)
    concat = a.encode_conditioning(vae, clip, None)["concat"]
    assert concat.shape == (20, 3, 4, 6)
    assert (concat[:4, 0] == 1).all() and (concat[:4, 1:] == 0).all()
    later = clip.clone()
    later[5] = 1 - later[5]
    assert torch.equal(a.encode_conditioning(vae, later, None)["concat"], concat)
    first = clip.clone()
    first[0] = 1 - first[0]
    assert not torch.allclose(a.encode_conditioning(vae, first, None)["concat"][4:], concat[4:])
    with pytest.raises(Exception, match="videos only"):
        a.encode_conditioning(vae, clip[:1], None)


def test_flf2v_conditioning_is_the_first_and_last_frames(tmp_path, model_files):
    """As ComfyUI's WanFirstLastFrameToVideo builds them (its own node run here on the same frames): ``concat`` =
    ComfyUI's mask + the latent of [first frame, mid-grey, last frame]; ``clip_fea`` = the first then the last
    frame's CLIP-vision tokens. A middle frame changes nothing, the last one changes the latent and tokens."""
    from pipetrain.backend.host.runtime import comfy_nodes
    comfy_nodes()   # ComfyUI's own ``nodes``, which nodes_wan imports (``python -m pytest`` puts our nodes/ first)
    import comfy_extras.nodes_wan as nodes_wan

    from pipetrain.backend.models import loading, tiny
    from pipetrain.backend.models.wan import WanFLF2VAdapter

    path = tmp_path / "clip_vision.safetensors"
    tiny.write_clip_vision(path)
    a = WanFLF2VAdapter(ModelConfig(type="wan_flf2v", diffusion_model="unused", vae="unused", clip_vision=str(path)))
    assert a.conditioning_fields == ("concat", "clip_fea")
    vae = loading.load_vae(model_files("wan").vae)
    clip = torch.rand(9, 32, 48, 3, generator=torch.Generator().manual_seed(0))
    out = a.encode_conditioning(vae, clip, None)

    vision = loading.load_clip_vision(path)
    first, last = (vision.encode_image(f, crop=False) for f in (clip[:1], clip[-1:]))
    text = [[torch.zeros(1, 1, 8), {}]]
    positive, _, latent = nodes_wan.WanFirstLastFrameToVideo.execute(
        text, text, vae, 48, 32, 9, 1, start_image=clip[:1], end_image=clip[-1:],
        clip_vision_start_image=first, clip_vision_end_image=last).args
    positive = positive[0][1]
    concat = _comfy_concat(torch.zeros(latent["samples"].shape), positive)
    assert out["concat"].shape == (20, 3, 4, 6)
    assert torch.allclose(out["concat"], concat[0], atol=1e-5)
    mask = out["concat"][:4]
    assert (mask[:, 0] == 1).all() and (mask[:, 1] == 0).all()
    assert (mask[:3, -1] == 0).all() and (mask[3, -1] == 1).all()   # the last pixel frame: the 4th channel
    assert torch.allclose(out["clip_fea"], positive["clip_vision_output"].penultimate_hidden_states[0].float())
    assert out["clip_fea"].shape == (514, 1280)

    middle = clip.clone()
    middle[4] = 1 - middle[4]
    assert torch.equal(a.encode_conditioning(vae, middle, None)["concat"], out["concat"])
    end = clip.clone()
    end[-1] = 1 - end[-1]
    changed = a.encode_conditioning(vae, end, None)
    assert not torch.allclose(changed["concat"][4:, -1], out["concat"][4:, -1])
    assert torch.equal(changed["clip_fea"][:257], out["clip_fea"][:257])
    assert not torch.allclose(changed["clip_fea"][257:], out["clip_fea"][257:])


def _comfy_concat(noise, cond):
    """ComfyUI's WAN21 (i2v) ``concat_cond`` on a node's conditioning values: the channels the model is given."""
    from pipetrain.backend.models.wan import wan_flf2v_config

    model = comfy_model("wan_flf2v", {**wan_flf2v_config("tiny"), "num_layers": 1}, dtype=torch.float32).model
    return model.concat_cond(noise=noise, device="cpu", **cond)


def test_tiny_clip_vision_gives_wan21_i2v_its_257_tokens(tmp_path, model_files):
    """A tiny CLIP-vision file (ViT-H/14 width, 2 layers; config in its metadata) through ComfyUI's
    ClipVisionModel: ``clip_fea`` is the first frame's penultimate hidden states, as CLIPVisionEncode gives."""
    from pipetrain.backend.models import loading, tiny
    from pipetrain.backend.models.wan import WanI2VAdapter

    path = tmp_path / "clip_vision.safetensors"
    tiny.write_clip_vision(path)
    assert path.stat().st_size < 100e6
    model = loading.load_clip_vision(path)
    a = WanI2VAdapter(ModelConfig(type="wan_i2v", diffusion_model="unused", vae="unused", clip_vision=str(path)))
    assert a.conditioning_fields == ("concat", "clip_fea")
    clip = torch.rand(9, 32, 48, 3, generator=torch.Generator().manual_seed(0))
    out = a.encode_conditioning(loading.load_vae(model_files("wan").vae), clip, None)
    expected = model.encode_image(clip[:1], crop=False)["penultimate_hidden_states"][0]
    assert out["clip_fea"].shape == (257, 1280) and torch.allclose(out["clip_fea"], expected.float())
    with pytest.raises(Exception, match="not recognise"):
        loading.load_clip_vision(model_files("wan").vae)


def test_min_t_max_t_restrict_the_shifted_timesteps():
    from pipetrain.backend.models.wan import WanAdapter

    def objective(**kw):
        return WanAdapter(ModelConfig(type="wan", diffusion_model="unused", vae="unused", shift=5.0, **kw)).objective()

    full, high, low = objective(), objective(min_t=0.875), objective(max_t=0.875)
    g = torch.Generator().manual_seed(0)
    draws = {name: torch.cat([o.sample_t(1, 64, g) for _ in range(4000)]) for name, o in
             (("full", full), ("high", high), ("low", low))}
    assert draws["high"].min() >= 0.875 and draws["low"].max() <= 0.875
    # the restricted draws follow the full distribution conditioned on the range
    inside = draws["full"][draws["full"] >= 0.875]
    for q in (0.25, 0.5, 0.75):
        assert abs(torch.quantile(draws["high"], q) - torch.quantile(inside, q)) < 0.01
    assert high.quantile_t(0.0, 64).item() == pytest.approx(0.875, abs=1e-4)
    assert low.quantile_t(1.0, 64).item() == pytest.approx(0.875, abs=1e-4)
    assert torch.equal(full.sample_t(3, 64, torch.Generator().manual_seed(1)),
                       objective(min_t=0.0, max_t=1.0).sample_t(3, 64, torch.Generator().manual_seed(1)))


def test_min_t_max_t_are_validated(tmp_path):
    from pipetrain.backend.errors import ConfigError
    from pipetrain.backend.preflight import check_model

    def model(**kw):   # the config's own check, then the architecture's (as the launcher and the CLI run them)
        cfg = ModelConfig(type=kw.pop("type", "wan"), diffusion_model="d", vae="v", **kw)
        cfg.validate(tmp_path / "run.toml")
        check_model(cfg, tmp_path / "run.toml")

    model(min_t=0.875, max_t=1.0)
    model(type="wan_i2v", max_t=0.9)
    with pytest.raises(ConfigError, match="min_t < max_t"):
        model(min_t=0.9, max_t=0.5)
    model(type="flux", max_t=0.5)          # every flow model (tests/unit/test_loss_options.py draws them)
    with pytest.raises(ConfigError, match="flow-matching models"):
        model(type="sdxl", max_t=0.5)
    with pytest.raises(ConfigError, match="CLIP-vision"):
        model(type="wan", clip_vision="clip_vision_h.safetensors")
