"""Wan 2.1 VACE and Fun-Control against ComfyUI: the layers compute VaceWanModel's / WanModel's forward, LoRA
gradients equal finite differences of that forward, ComfyUI's model denoises the training target back to the clean
latent, every layer boundary can be a stage boundary; ComfyUI detects both layouts; the cached conditioning is what
ComfyUI's WanVaceToVideo / WanFunControlToVideo nodes and its model's conds make of the same frames."""
import pytest
import torch
from layer_checks import (comfy_model, every_boundary_is_a_stage_boundary_with_lora, give_lora_b_values,
                          layers_match_comfyui_forward, lora_gradients_match_finite_differences, run_layers)

from pipetrain.backend.adapters import injection
from pipetrain.backend.config import ModelConfig
from pipetrain.backend.host.runtime import ensure_comfyui

ensure_comfyui()
TEXT = 48


def _adapter(arch):
    from pipetrain.backend.models.registry import adapter_class
    from pipetrain.backend.models.wan import wan_config

    if arch == "wan_vace":   # 4 blocks, VACE blocks after blocks 0 and 2
        config = {**wan_config(64, 96, 4, model_type="vace"), "vace_in_dim": 96, "vace_layers": 2}
    else:
        config = wan_config(64, 96, 2, in_dim=48, model_type="i2v")
    config.update(num_heads=2, text_dim=TEXT, freq_dim=32)
    clip_vision = "clip_vision_h.safetensors" if arch == "wan_fun_control" else None
    adapter = adapter_class(arch)(ModelConfig(type=arch, diffusion_model="unused", vae="unused",
                                              clip_vision=clip_vision))
    adapter.dtype = torch.float64
    adapter.use_model(comfy_model(arch, config, std=0.08))
    return adapter


@pytest.fixture(scope="module", params=["wan_vace", "wan_fun_control"])
def small(request):
    return _adapter(request.param)


def _inputs(adapter, batch=2, size=(3, 6, 10), seed=1):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(batch, 16, *size, generator=g, dtype=torch.float64)
    noise = torch.randn(x0.shape, generator=g, dtype=torch.float64)
    t = torch.tensor([0.25, 0.8], dtype=torch.float64)
    text = torch.randn(batch, 7, TEXT, generator=g, dtype=torch.float64)
    cond = {"vace_context": torch.randn(batch, 96, *size, generator=g, dtype=torch.float64),
            "concat": torch.randn(batch, 32, *size, generator=g, dtype=torch.float64),
            "clip_fea": torch.randn(batch, 257, 1280, generator=g, dtype=torch.float64)}
    return (x0, noise, t, text, *(cond[name] for name in adapter.conditioning_fields))


def test_comfyui_detects_both_layouts():
    import comfy.model_detection
    import comfy.supported_models as sm

    from pipetrain.backend.models import loading, tiny
    from pipetrain.backend.models.registry import arch_spec

    for arch, comfy_class in (("wan_vace", sm.WAN21_Vace), ("wan_fun_control", sm.WAN21_FunControl2V)):
        spec = arch_spec(arch)
        for size in ("tiny", "full"):
            config = spec.unet_config(size)
            sd = {k: torch.empty(s, device="meta") for k, s, _ in tiny.tensor_plan(spec.build(config))}
            assert type(comfy.model_detection.model_config_from_unet(sd, "")) is comfy_class
            assert comfy.model_detection.detect_unet_config(sd, "") == config
            assert loading.arch_from_state_dict_shapes({k: v.shape for k, v in sd.items()}) == arch


def test_layers_match_comfyui_forward(small):
    layers_match_comfyui_forward(small, _inputs(small))


def test_training_targets_agree_with_comfyui_model(small):
    a = small
    ms, objective = a.patcher.model.model_sampling, a.objective()
    x0, noise, t, text, *conditioning = inputs = _inputs(a)
    cond = dict(zip(a.conditioning_fields, conditioning))
    kwargs = {"vace_context": cond["vace_context"][:, None], "vace_strength": [1.0]} if "vace_context" in cond \
        else {"c_concat": cond["concat"], "clip_fea": cond["clip_fea"]}
    x_comfy = ms.noise_scaling(t, noise, x0)
    with torch.no_grad():
        comfy_denoised = a.patcher.model.apply_model(x_comfy, t, c_crossattn=text, **kwargs)
        ours = ms.calculate_denoised(t, run_layers(a.to_layers(), inputs), x_comfy)
    assert torch.allclose(ms.calculate_denoised(t, objective.target(x0, noise, t), x_comfy), x0)
    assert (comfy_denoised - ours).abs().max() / ours.abs().max() < 1e-6


def test_lora_gradients_match_finite_differences_of_comfyui_forward(small):
    a = small
    dm = a.diffusion_model
    names = injection.inject(dm, injection.AdapterSpec(rank=4, alpha=4.0, dtype=torch.float64), a.lora_block_prefixes)
    blocks, per_block = (4, 10) if a.arch == "wan_vace" else (2, 12)   # Fun-Control: + k_img / v_img
    assert len(names) == blocks * per_block and not any(n.startswith("vace") for n in names)
    give_lora_b_values(dm)
    lora_gradients_match_finite_differences(a, _inputs(a), eps=1e-4)


def test_every_layer_boundary_can_be_a_deepspeed_stage_boundary(small):
    every_boundary_is_a_stage_boundary_with_lora(small, _inputs(small))


def _frames(seed, count=9):
    return torch.rand(count, 32, 48, 3, generator=torch.Generator().manual_seed(seed))


def test_vace_conditioning_is_comfyuis(model_files):
    """``vace_context`` = WAN21_Vace.extra_conds of WanVaceToVideo's output (strength 1, no mask): the control's
    inactive / reactive latents scaled, then the all-ones 64-channel mask; another control video changes it."""
    from pipetrain.backend.models import loading
    from pipetrain.backend.models.wan import nodes_wan
    from pipetrain.backend.models.wan_control import wan_vace_config

    a = _adapter("wan_vace")
    vae = loading.load_vae(model_files("wan").vae)
    clip, control = _frames(0), _frames(1)
    ours = a.encode_conditioning(vae, clip, control)["vace_context"]
    text = [[torch.zeros(1, 1, 8), {}]]
    positive, _, latent, trim = nodes_wan().WanVaceToVideo.execute(text, text, vae, 48, 32, 9, 1, 1.0,
                                                                    control_video=control).args
    model = comfy_model("wan_vace", {**wan_vace_config("tiny"), "num_layers": 1}, dtype=torch.float32).model
    values = positive[0][1]
    conds = model.extra_conds(noise=torch.zeros(latent["samples"].shape), device="cpu", vace_frames=values["vace_frames"],
                              vace_mask=values["vace_mask"], vace_strength=values["vace_strength"])
    assert trim == 0 and ours.shape == (96, 3, 4, 6)
    assert torch.allclose(ours, conds["vace_context"].cond[0, 0], atol=1e-5)
    assert (ours[32:] == 1).all() and conds["vace_strength"].cond == [1.0]
    assert not torch.allclose(a.encode_conditioning(vae, clip, _frames(3))["vace_context"][:32], ours[:32])


def test_fun_control_conditioning_is_comfyuis(model_files):
    """``concat`` = WAN21.concat_cond of WanFunControlToVideo's output with the control video and the clip's first
    frame as start image: the control's latent, then the first frame's latent and zeros, both scaled."""
    from pipetrain.backend.models import loading
    from pipetrain.backend.models.wan import nodes_wan
    from pipetrain.backend.models.wan_control import wan_fun_control_config

    a = _adapter("wan_fun_control")
    a.conditioning_fields = ("concat",)   # no CLIP-vision file here
    vae = loading.load_vae(model_files("wan").vae)
    clip, control = _frames(0), _frames(1)
    ours = a.encode_conditioning(vae, clip, control)["concat"]
    text = [[torch.zeros(1, 1, 8), {}]]
    positive, _, latent = nodes_wan().WanFunControlToVideo.execute(
        text, text, vae, 48, 32, 9, 1, start_image=clip[:1], control_video=control).args
    model = comfy_model("wan_fun_control", {**wan_fun_control_config("tiny"), "num_layers": 1},
                        dtype=torch.float32).model
    concat = model.concat_cond(noise=torch.zeros(latent["samples"].shape), device="cpu", **positive[0][1])
    assert ours.shape == (32, 3, 4, 6)
    assert torch.allclose(ours, concat[0], atol=1e-5)
    assert (ours[16:, 1:] == 0).all() and ours[16:, 0].abs().sum() > 0
    later = clip.clone()
    later[4] = 1 - later[4]
    assert torch.equal(a.encode_conditioning(vae, later, control)["concat"], ours)
    assert not torch.allclose(a.encode_conditioning(vae, clip, _frames(3))["concat"][:16], ours[:16])
    with pytest.raises(Exception, match="videos only"):
        a.encode_conditioning(vae, clip[:1], control[:1])


def test_a_short_control_gives_its_own_frames_only(tmp_path):
    """ComfyUI's nodes fill what a control lacks (WanVaceToVideo: grey): a short control video is not stretched
    by holding its last frame, and a control image is one frame."""
    from media import moving_square, write_video
    from PIL import Image

    from pipetrain.backend.cache.builder import _control_video

    path = write_video(tmp_path / "a.mp4", moving_square(5), 16)
    assert _control_video(path, (64, 64, 9), 16).shape == (5, 64, 64, 3)
    assert _control_video(path, (64, 64, 3), 16).shape == (3, 64, 64, 3)
    Image.fromarray(moving_square(1)[0]).save(tmp_path / "b.png")
    assert _control_video(tmp_path / "b.png", (64, 64, 9), 16).shape == (1, 64, 64, 3)
