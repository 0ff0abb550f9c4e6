"""Z-Image and Lumina Image 2.0 pipeline layers against ComfyUI's NextDiT: the same output as its forward
run one sample at a time with its own caption (captions of different lengths share the micro-batch, padded
and masked), LoRA gradients equal to finite differences of that forward, training targets ComfyUI's flow
sampling turns back into the clean latent, and tuples DeepSpeed's pipeline can cut anywhere; plus the
real-layout detection and the tiny files."""
import pytest
import torch
from layer_checks import (comfy_model, every_boundary_is_a_stage_boundary_with_lora, give_lora_b_values,
                          layers_match_comfyui_forward, lora_gradients_match_finite_differences, run_layers)

from pipetrain.backend.adapters import injection
from pipetrain.backend.config import ModelConfig
from pipetrain.backend.host.runtime import ensure_comfyui

ensure_comfyui()
TEXT = 40
ARCHS = ("z_image", "lumina2")


def _small_config(arch: str) -> dict:
    """Float64-sized NextDiTs: Z-Image's modulation needs width >= 256 (its timestep embedding is 256 wide);
    its caption and image pad tokens come in multiples of 8 here (32 in the real one) so that captions of
    5 and 11 tokens pad to different lengths. Lumina 2 keeps grouped-query attention."""
    from pipetrain.backend.models.lumina import LUMINA2_HEADS, ZIMAGE_HEADS, nextdit_config

    if arch == "z_image":
        heads = {**ZIMAGE_HEADS, "n_heads": 4, "n_kv_heads": 4, "axes_dims": [16, 24, 24],
                 "pad_tokens_multiple": 8, "multiple_of": 32}
        return nextdit_config(256, 2, TEXT, **heads)
    heads = {**LUMINA2_HEADS, "n_heads": 2, "n_kv_heads": 1, "axes_dims": [8, 12, 12], "multiple_of": 32}
    return nextdit_config(64, 2, TEXT, **heads)


@pytest.fixture(scope="module", params=ARCHS)
def small(request):
    """ComfyUI's own ``model_base.Lumina2`` (with Z-Image's or Lumina 2's model_sampling) in float64."""
    from pipetrain.backend.models.registry import adapter_class

    arch = request.param
    adapter = adapter_class(arch)(ModelConfig(type=arch, diffusion_model="unused", vae="unused"))
    adapter.dtype = torch.float64
    adapter.use_model(comfy_model(arch, _small_config(arch), std=0.05))
    return adapter


def _inputs(batch=2, size=(6, 10), lengths=(5, 11), seed=1):
    """A 6 x 10 latent (15 patches: Z-Image pads them to 16) and captions of different lengths, zero-padded
    to the longest as ``collate_text`` gives them."""
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(batch, 16, *size, generator=g, dtype=torch.float64)
    noise = torch.randn(x0.shape, generator=g, dtype=torch.float64)
    t = torch.tensor([0.25, 0.8, 0.05][:batch], dtype=torch.float64)
    lengths = torch.tensor(lengths[:batch])
    cond = torch.randn(batch, int(lengths.max()), TEXT, generator=g, dtype=torch.float64)
    cond = cond * (torch.arange(cond.shape[1])[None, :, None] < lengths[:, None, None])
    return x0, noise, t, cond, lengths


def _meta_state_dict(arch, size):
    from pipetrain.backend.models import tiny

    return {k: torch.empty(s, device="meta") for k, s, _ in tiny.tensor_plan(tiny.build_diffusion_model(arch, size))}


@pytest.mark.parametrize("arch, comfy_class", [("z_image", "ZImage"), ("lumina2", "Lumina2")])
def test_comfyui_detects_the_full_layouts(arch, comfy_class):
    """Z-Image 6B and Lumina 2 (2.6B) as ComfyUI's detection reads them; the narrow tiny ones it would take
    for something else, so their config travels in the file."""
    import comfy.model_detection
    import comfy.supported_models

    from pipetrain.backend.models import loading
    from pipetrain.backend.models.lumina import NEXTDIT_CONFIGS

    sd = _meta_state_dict(arch, "full")
    assert type(comfy.model_detection.model_config_from_unet(sd, "")) is getattr(comfy.supported_models, comfy_class)
    assert comfy.model_detection.detect_unet_config(sd, "") == NEXTDIT_CONFIGS[arch]["full"]
    assert loading.arch_from_state_dict_shapes({k: v.shape for k, v in sd.items()}) == arch
    tiny_sd = _meta_state_dict(arch, "tiny")
    assert comfy.model_detection.detect_unet_config(tiny_sd, "") != NEXTDIT_CONFIGS[arch]["tiny"]


def test_tiny_z_image_files_load_through_comfyui(model_files):
    """The diffusion model through its metadata as ComfyUI's Z-Image (shift 3, multiplier 1), the Flux VAE,
    and Qwen3-4B with the chat template ComfyUI wraps a prompt in."""
    from pipetrain.backend.models import loading

    files = model_files("z_image")
    patcher = loading.load_diffusion_model(files.diffusion_model, torch.float32, arch="z_image")
    assert type(patcher.model.model_config).__name__ == "ZImage"
    dm = patcher.model.diffusion_model
    assert dm.dim == 256 and dm.pad_tokens_multiple == 32 and dm.time_scale == 1000.0
    assert (patcher.model.model_sampling.multiplier, patcher.model.model_sampling.shift) == (1.0, 3.0)
    vae = loading.load_vae(files.vae, arch="z_image")
    assert vae.latent_channels == 16
    shapes, meta = loading.read_header(files.text_encoders[0])
    assert meta["pipetrain.te_kind"] == "qwen3_4b" and shapes["model.embed_tokens.weight"] == (151936, 64)
    clip = loading.load_text_encoders(files.text_encoders, "z_image", torch.float32)
    tokens = clip.tokenize("a red cube")
    assert tokens["qwen3_4b"][0][0][0] == 151644          # <|im_start|>: ComfyUI's Z-Image template
    cond = clip.encode_from_tokens(tokens, return_dict=True)["cond"]
    assert cond.shape == (1, len(tokens["qwen3_4b"][0]), 64)


def test_tiny_lumina2_files_load_through_comfyui(model_files):
    """Gemma-2-2B's tokenizer travels in its file as in real ones; captions are encoded as ComfyUI's
    CLIPTextEncodeLumina2 encodes a prompt (its default system prompt)."""
    from comfy_extras.nodes_lumina2 import CLIPTextEncodeLumina2

    from pipetrain.backend.models import loading
    from pipetrain.backend.models.lumina import Lumina2Adapter

    files = model_files("lumina2")
    patcher = loading.load_diffusion_model(files.diffusion_model, torch.float32, arch="lumina2")
    assert type(patcher.model.model_config).__name__ == "Lumina2"
    assert (patcher.model.model_sampling.multiplier, patcher.model.model_sampling.shift) == (1.0, 6.0)
    shapes, meta = loading.read_header(files.text_encoders[0])
    assert meta["pipetrain.te_kind"] == "gemma2_2b" and "spiece_model" in shapes
    clip = loading.load_text_encoders(files.text_encoders, "lumina2", torch.float32)
    adapter = Lumina2Adapter(ModelConfig(type="lumina2", diffusion_model="unused", vae="unused"))
    ours = adapter.encode_caption(clip, "a red cube")["cond"]
    (node,) = CLIPTextEncodeLumina2.execute(clip, "a red cube", "superior").args
    assert ours.shape[-1] == 2304 and torch.equal(ours, node[0][0][0].float())


def test_layers_match_comfyui_forward_with_captions_of_different_lengths(small):
    a = small
    x0, noise, t, *text = inputs = _inputs()
    ours = layers_match_comfyui_forward(a, inputs)
    with torch.no_grad():
        alone = run_layers(a.to_layers(), tuple(v[:1] for v in inputs[:3]) + (text[0][:1, :5], text[1][:1]))
    assert torch.allclose(ours[:1], alone, atol=1e-12)


def test_training_targets_agree_with_comfyui_flow_sampling(small):
    """ComfyUI feeds sigma itself (multiplier 1); the network embeds 1 - sigma and returns minus its output."""
    a = small
    model, objective = a.patcher.model, a.objective()
    ms = model.model_sampling
    assert objective.multiplier == ms.multiplier == 1.0 and objective.shift is None
    assert ms.shift == {"z_image": 3.0, "lumina2": 6.0}[a.arch]
    x0, noise, t, cond, lengths = _inputs(lengths=(9, 9))
    x_comfy = ms.noise_scaling(t, noise, x0)
    assert torch.allclose(ms.calculate_input(t, x_comfy), objective.noisy(x0, noise, t))
    assert torch.allclose(ms.calculate_denoised(t, objective.target(x0, noise, t), x_comfy), x0)
    with torch.no_grad():
        comfy_denoised = model.apply_model(x_comfy, t, c_crossattn=cond, num_tokens=9)
        ours = ms.calculate_denoised(t, run_layers(a.to_layers(), (x0, noise, t, cond, lengths)), x_comfy)
    assert (comfy_denoised - ours).abs().max() / ours.abs().max() < 1e-6


def test_lora_targets_every_linear_of_the_layers_and_refiners_as_comfyui_keys_them(small):
    import comfy.lora

    a = small
    dm = a.diffusion_model
    if not list(injection.adapted_modules(dm)):
        injection.inject(dm, injection.AdapterSpec(rank=4, alpha=4.0, dtype=torch.float64), a.lora_block_prefixes)
    names = [m.lora_name for m in injection.adapted_modules(dm)]
    modulation = {"z_image": "adaLN_modulation.0", "lumina2": "adaLN_modulation.1"}[a.arch]
    per_block = ["attention.qkv", "attention.out", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]
    want = [f"{stack}.{i}.{n}" for stack in ("noise_refiner", "layers") for i in range(2)
            for n in per_block + [modulation]]
    want += [f"context_refiner.{i}.{n}" for i in range(2) for n in per_block]   # unmodulated
    assert sorted(names) == sorted(want)
    keys = comfy.lora.model_lora_keys_unet(a.patcher.model, {})
    assert all(keys.get(f"diffusion_model.{n}") == f"diffusion_model.{n}.weight" for n in names)


def test_lora_gradients_match_finite_differences_of_comfyui_forward(small):
    a = small
    dm = a.diffusion_model
    if not list(injection.adapted_modules(dm)):
        injection.inject(dm, injection.AdapterSpec(rank=4, alpha=4.0, dtype=torch.float64), a.lora_block_prefixes)
    give_lora_b_values(dm)
    lora_gradients_match_finite_differences(a, _inputs(), eps=1e-4)   # ComfyUI's RoPE runs in float32


def test_every_layer_boundary_can_be_a_deepspeed_stage_boundary(small):
    a = small
    every_boundary_is_a_stage_boundary_with_lora(a, _inputs())
