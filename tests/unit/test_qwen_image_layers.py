"""Qwen-Image and Qwen-Image-Edit pipeline layers against ComfyUI's QwenImageTransformer2DModel: the same output
as its forward (captions of different lengths masked; Edit's reference latents as extra tokens), LoRA gradients
equal to finite differences of that forward, training targets ComfyUI's flow sampling turns back into the clean
latent, and tuples DeepSpeed's pipeline can cut anywhere; plus the real-layout and tiny files."""
import math

import pytest
import torch
from layer_checks import (comfy_model, every_boundary_is_a_stage_boundary_with_lora, give_lora_b_values,
                          layers_match_comfyui_forward, lora_gradients_match_finite_differences, run_layers)

from pipetrain.backend.adapters import injection
from pipetrain.backend.config import ModelConfig
from pipetrain.backend.host.runtime import ensure_comfyui

ensure_comfyui()
TEXT = 24   # Qwen2.5-VL-7B's width is 3584


def _adapter(model_type):
    from pipetrain.backend.models.qwen_image import QwenImageAdapter, QwenImageEditAdapter, qwen_image_config

    cls = {"qwen_image": QwenImageAdapter, "qwen_image_edit": QwenImageEditAdapter}[model_type]
    config = qwen_image_config(2, num_attention_heads=2, attention_head_dim=32, axes_dims_rope=(8, 12, 12),
                               joint_attention_dim=TEXT)
    adapter = cls(ModelConfig(type=model_type, diffusion_model="unused", vae="unused"))
    adapter.dtype = torch.float64
    adapter.use_model(comfy_model(model_type, config, std=0.08))
    return adapter


@pytest.fixture(scope="module")
def small_qwen():
    """ComfyUI's own ``model_base.QwenImage`` in float64: width 64 (2 heads of 32), 2 blocks."""
    return _adapter("qwen_image")


@pytest.fixture(scope="module")
def small_qwen_edit():
    return _adapter("qwen_image_edit")


def _inputs(batch=2, size=(5, 7), lengths=(9, 5), seed=1, reference=False):
    """An odd latent grid on purpose (padded to patches); captions of different lengths (zero-padded)."""
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(batch, 16, 1, *size, generator=g, dtype=torch.float64)
    noise = torch.randn(x0.shape, generator=g, dtype=torch.float64)
    t = torch.tensor([0.25, 0.8, 0.05][:batch], dtype=torch.float64)
    lengths = torch.tensor(lengths[:batch])
    context = torch.randn(batch, int(lengths.max()), TEXT, generator=g, dtype=torch.float64)
    for i, n in enumerate(lengths):
        context[i, n:] = 0
    extra = [torch.randn(x0.shape, generator=g, dtype=torch.float64)] if reference else []
    return (x0, noise, t, context, lengths, *extra)


def test_comfyui_detects_the_full_layout_as_qwen_image_and_its_text_encoder_as_qwen25_7b():
    import comfy.model_detection
    import comfy.sd
    import comfy.supported_models

    from pipetrain.backend.models import loading, tiny
    from pipetrain.backend.models.qwen_image import QWEN_CONFIGS

    plan = tiny.tensor_plan(tiny.build_diffusion_model("qwen_image", "full"))
    sd = {k: torch.empty(s, device="meta") for k, s, _ in plan}
    assert type(comfy.model_detection.model_config_from_unet(sd, "")) is comfy.supported_models.QwenImage
    assert comfy.model_detection.detect_unet_config(sd, "") == QWEN_CONFIGS["full"]
    assert sum(v.numel() for v in sd.values()) > 20e9                       # Qwen-Image's 20B
    # an edit checkpoint has the same layout: detection names the base model, the edit type is chosen
    assert loading.arch_from_state_dict_shapes({k: v.shape for k, v in sd.items()}) == "qwen_image"
    te = tiny.build_text_encoder("qwen25_7b", tiny.text_encoder_config("qwen25_7b", "full"))
    te_sd = {k: torch.empty(v.shape, device="meta") for k, v in te.state_dict().items()}
    assert comfy.sd.detect_te_model(te_sd) is comfy.sd.TEModel.QWEN25_7B and any(k.startswith("visual.") for k in te_sd)
    assert loading._real_te_kind({k: v.shape for k, v in te_sd.items()}) == "qwen25_7b"


def test_tiny_qwen_image_files_load_through_comfyui(model_files):
    """The diffusion model through its metadata, the VAE (Wan 2.1's class) through ComfyUI's detection, the
    tiny Qwen2.5-VL through its metadata without the vision tower; captions through ComfyUI's template."""
    from pipetrain.backend.models import loading
    from pipetrain.backend.models.qwen_image import QwenImageAdapter, QwenImageEditAdapter

    files = model_files("qwen_image")
    patcher = loading.load_diffusion_model(files.diffusion_model, torch.float32)
    assert type(patcher.model).__name__ == "QwenImage" and len(patcher.model.diffusion_model.transformer_blocks) == 2
    vae = loading.load_vae(files.vae, arch="qwen_image")
    assert type(vae.first_stage_model).__name__ == "WanVAE"
    shapes, meta = loading.read_header(files.text_encoders[0])
    assert meta["pipetrain.te_kind"] == "qwen25_7b" and not any(k.startswith("visual.") for k in shapes)
    clip = loading.load_text_encoders(files.text_encoders, "qwen_image", torch.float32)
    cfg = ModelConfig(type="qwen_image", diffusion_model=str(files.diffusion_model), vae=str(files.vae))
    adapter = QwenImageAdapter(cfg)
    assert adapter.encode_images(vae, torch.rand(2, 32, 48, 3)).shape == (2, 16, 1, 4, 6)   # one frame each
    # ComfyUI drops the system prompt and "<|im_start|>user\n": 6 caption tokens + the 5 closing ones
    assert adapter.encode_caption(clip, "a red cube on a table")["context"].shape == (11, 64)
    edit = QwenImageEditAdapter(ModelConfig(type="qwen_image_edit", diffusion_model="x", vae="x"))
    ids = [tok for tok, *_ in edit.tokenize(clip, "make it blue")["qwen25_7b"][0]]
    assert 151655 not in ids and len(ids) > 60   # the edit system prompt, no vision placeholder
    ref = edit.encode_conditioning(vae, torch.rand(1, 32, 48, 3), torch.rand(1, 32, 48, 3))["reference"]
    assert ref.shape == (16, 1, 4, 6)


@pytest.mark.parametrize("model_type", ["qwen_image", "qwen_image_edit"])
def test_layers_match_comfyui_forward(small_qwen, small_qwen_edit, model_type):
    a = small_qwen if model_type == "qwen_image" else small_qwen_edit
    layers_match_comfyui_forward(a, _inputs(reference=model_type == "qwen_image_edit"))


def test_reference_latents_change_the_output(small_qwen_edit):
    a = small_qwen_edit
    inputs = _inputs(reference=True)
    other = (*inputs[:-1], inputs[-1] + 1.0)
    with torch.no_grad():
        assert (run_layers(a.to_layers(), inputs) - run_layers(a.to_layers(), other)).abs().max() > 1e-3


def test_training_targets_agree_with_comfyui_flow_sampling(small_qwen, small_qwen_edit):
    from pipetrain.backend.models.qwen_image import QWEN_SHIFT

    for a in (small_qwen, small_qwen_edit):
        model, objective = a.patcher.model, a.objective()
        ms = model.model_sampling
        import comfy.model_sampling
        assert isinstance(ms, comfy.model_sampling.ModelSamplingFlux) and ms.shift == 1.15
        assert QWEN_SHIFT == math.exp(1.15)
        # ComfyUI's sampling schedule is the constant shift the timesteps are drawn with
        q = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
        assert torch.allclose(objective._shift(q, 0).double(), ms.sigma(q).double(), atol=1e-6)
        assert torch.allclose(ms.timestep(q), q) and objective.multiplier == 1.0
        x0, noise, t, context, lengths, *ref = inputs = _inputs(batch=1, reference=a.conditioning_fields != ())
        x_comfy = ms.noise_scaling(t, noise, x0)
        assert torch.allclose(ms.calculate_input(t, x_comfy), objective.noisy(x0, noise, t))
        assert torch.allclose(ms.calculate_denoised(t, objective.target(x0, noise, t), x_comfy), x0)
        with torch.no_grad():
            comfy_denoised = model.apply_model(x_comfy, t, c_crossattn=context, **({"ref_latents": ref} if ref else {}))
            ours = ms.calculate_denoised(t, run_layers(a.to_layers(), inputs), x_comfy)
        assert (comfy_denoised - ours).abs().max() / ours.abs().max() < 1e-6


def test_lora_targets_every_block_linear_that_reaches_the_output(small_qwen):
    import copy
    dm = copy.deepcopy(small_qwen.diffusion_model)
    spec = injection.AdapterSpec(rank=2, alpha=2.0, dtype=torch.float64)
    names = injection.inject(dm, spec, small_qwen.lora_block_prefixes)
    assert len(names) == 14 + 10
    assert "transformer_blocks.0.attn.to_add_out" in names and "transformer_blocks.0.txt_mlp.net.2" in names
    assert "transformer_blocks.1.img_mod.1" in names and "transformer_blocks.1.attn.add_k_proj" in names
    # the last block's text stream feeds only keys and values to the image tokens
    last = ("transformer_blocks.1.attn.to_add_out", "transformer_blocks.1.attn.add_q_proj",
            "transformer_blocks.1.txt_mlp")
    assert not any(n.startswith(last) for n in names)


@pytest.mark.parametrize("model_type", ["qwen_image", "qwen_image_edit"])
def test_lora_gradients_match_finite_differences_of_comfyui_forward(small_qwen, small_qwen_edit, model_type):
    a = small_qwen if model_type == "qwen_image" else small_qwen_edit
    dm = a.diffusion_model
    if not list(injection.adapted_modules(dm)):
        injection.inject(dm, injection.AdapterSpec(rank=4, alpha=4.0, dtype=torch.float64), a.lora_block_prefixes)
        give_lora_b_values(dm)
    lora_gradients_match_finite_differences(a, _inputs(reference=model_type == "qwen_image_edit"), eps=1e-5)


@pytest.mark.parametrize("model_type", ["qwen_image", "qwen_image_edit"])
def test_every_layer_boundary_can_be_a_deepspeed_stage_boundary(small_qwen, small_qwen_edit, model_type):
    a = small_qwen if model_type == "qwen_image" else small_qwen_edit
    every_boundary_is_a_stage_boundary_with_lora(a, _inputs(reference=model_type == "qwen_image_edit"))
