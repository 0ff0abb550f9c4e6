# SPDX-License-Identifier: GPL-3.0-or-later
"""diffusion-pipe's Qwen-Image ``diffusers_path``: a Diffusers Qwen-Image pipeline folder's VAE (diffusers'
AutoencoderKLQwenImage) and Qwen2.5-VL text encoder (Hugging Face, either key layout) load in ComfyUI, renamed to
its keys (``backend/config/model_folders.py``), as the networks diffusers / transformers run from the same weights: the
same latents for the same pixels, the same hidden states for the same tokens."""
from __future__ import annotations

import json

import pytest
import torch

from pipetrain.backend.config.model_folders import qwen_vl_state_dict, text_encoder_kind, wan_vae_state_dict

QWEN_VAE = dict(base_dim=16, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                temperal_downsample=[False, True, True])   # Qwen-Image's layout at a sixth of its width (96)


def test_the_vae_folder_gives_comfyuis_wan_vae_with_the_same_latents(tmp_path):
    from diffusers import AutoencoderKLQwenImage

    from pipetrain.backend.models.loading import load_vae
    torch.manual_seed(0)
    ours = AutoencoderKLQwenImage(**QWEN_VAE).eval()
    ours.save_pretrained(tmp_path / "vae")
    vae = load_vae(tmp_path / "vae", arch="qwen_image")
    comfy_keys = set(vae.first_stage_model.state_dict())
    assert set(wan_vae_state_dict(ours.state_dict())) == comfy_keys   # every key renamed, none left over
    pixels = torch.rand(1, 3, 1, 64, 48) * 2 - 1
    with torch.no_grad():
        want = ours.encode(pixels).latent_dist.mode()
        got = vae.first_stage_model.encode(pixels)
        assert got.shape == want.shape == (1, 16, 1, 8, 6)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(vae.first_stage_model.decode(want), ours.decode(want).sample, atol=1e-4,
                                   rtol=1e-4)


def test_wan_vae_keys_follow_the_original_flat_decoder_list():
    sd = {"decoder.up_blocks.1.resnets.0.conv_shortcut.weight": 0, "decoder.up_blocks.2.upsamplers.0.time_conv.bias": 0,
          "decoder.up_blocks.3.resnets.2.norm2.gamma": 0, "encoder.mid_block.resnets.1.conv2.bias": 0,
          "encoder.down_blocks.5.resample.1.weight": 0, "post_quant_conv.weight": 0, "decoder.norm_out.gamma": 0,
          "decoder.up_blocks.0.resnets.2.conv1.weight": 0}
    assert sorted(wan_vae_state_dict(sd)) == sorted([
        "decoder.upsamples.4.shortcut.weight", "decoder.upsamples.11.time_conv.bias",
        "decoder.upsamples.14.residual.3.gamma", "encoder.middle.2.residual.6.bias",
        "encoder.downsamples.5.resample.1.weight", "conv2.weight", "decoder.head.0.gamma",
        "decoder.upsamples.2.residual.2.weight"])


def _tiny_qwen_vl():
    """A Hugging Face Qwen2.5-VL whose language model ComfyUI's Qwen25_7BVLI can be: ComfyUI fixes the head width
    at 128 (Hugging Face derives it as width / heads), so 2 heads of 128; the real vocabulary and RoPE sections."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    config = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=152064, rms_norm_eps=1e-6,
                         rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=256))
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


@pytest.mark.parametrize("layout", ["transformers 5 (model.language_model.*)", "transformers 4 (model.*)"])
def test_the_text_encoder_folder_gives_comfyuis_qwen25_vl_with_the_same_hidden_states(tmp_path, layout):
    from safetensors.torch import save_file

    from pipetrain.backend.models.loading import load_text_encoders
    model = _tiny_qwen_vl()
    sd = {k: v.contiguous() for k, v in model.state_dict().items()
          if ".visual." not in k}   # ComfyUI's vision tower is fixed at 1280 wide; captions alone never run it
    if layout.startswith("transformers 4"):
        sd = {k.replace("model.language_model.", "model."): v for k, v in sd.items()}
    folder = tmp_path / "text_encoder"
    folder.mkdir()
    save_file(sd, str(folder / "model.safetensors"))
    config = model.config.to_dict()
    (folder / "config.json").write_text(json.dumps(config))
    assert text_encoder_kind(config) == "qwen25_7b"
    assert "lm_head.weight" in sd and "lm_head.weight" not in qwen_vl_state_dict(sd)
    clip = load_text_encoders([folder], "qwen_image", torch.float32)
    comfy = clip.cond_stage_model.qwen25_7b.transformer
    tokens = torch.randint(0, 151000, (1, 12))
    with torch.no_grad():
        want = model.model.language_model(input_ids=tokens).last_hidden_state
        got, _ = comfy(tokens)
    torch.testing.assert_close(got.float(), want, atol=1e-4, rtol=1e-4)


def test_published_qwen25_vl_7b_keys_and_shapes_are_comfyuis_after_the_rename():
    """Qwen-Image's text_encoder/ at its published sizes (built on the meta device: no weights), vision tower
    included: every renamed key is one of ComfyUI's Qwen25_7BVLI with its shape, and ComfyUI's has no other."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from pipetrain.backend.models.encoders import TEXT_ENCODERS
    from pipetrain.backend.models.tiny import text_encoder_config
    config = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064,
                         rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31]))
    with torch.device("meta"):
        hf = Qwen2_5_VLForConditionalGeneration(config)
    renamed = {k: tuple(v.shape) for k, v in qwen_vl_state_dict(hf.state_dict()).items()}
    comfy = TEXT_ENCODERS["qwen25_7b"].build(text_encoder_config("qwen25_7b", "full"))
    want = {k: tuple(v.shape) for k, v in comfy.state_dict().items()}
    assert renamed == want
