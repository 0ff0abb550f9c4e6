# SPDX-License-Identifier: GPL-3.0-or-later
"""SDXL and SD1.5 Diffusers folders (diffusion-pipe's ``diffusers_path`` / ``checkpoint_path``) at their published
sizes, with no weights in memory.

ComfyUI tells a Diffusers UNet's model by matching its shapes against the configs it knows (the published ones), so
a tiny UNet folder is never recognised, and a real one is gigabytes. Here diffusers' own ``UNet2DConditionModel`` is
built on the meta device from the published ``unet/config.json`` values, and its state dict (shapes only, the keys a
real folder's shards hold) goes through the path a folder takes in PipeTrain: the detection (``read_header`` ->
ComfyUI's detection: the model type), ComfyUI's Diffusers-to-ComfyUI key conversion (``comfy_layout``, what the
memory plan and the checks use) and ComfyUI's own loader (``load_diffusion_model`` -> ``comfy.sd.
load_diffusion_model_state_dict``, the model built on the meta device). The converted keys and shapes must be
exactly those of ComfyUI's UNet for the published config, with nothing missing and nothing left over.
"""
from __future__ import annotations

import logging

import pytest

# the published unet/config.json values that differ from diffusers' UNet2DConditionModel defaults
SDXL_UNET = dict(sample_size=128, block_out_channels=[320, 640, 1280], layers_per_block=2,
                 down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
                 up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
                 cross_attention_dim=2048, attention_head_dim=[5, 10, 20], transformer_layers_per_block=[1, 2, 10],
                 addition_embed_type="text_time", addition_time_embed_dim=256,
                 projection_class_embeddings_input_dim=2816, use_linear_projection=True)
SD15_UNET = dict(sample_size=64, block_out_channels=[320, 640, 1280, 1280], layers_per_block=2,
                 down_block_types=["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D",
                                   "DownBlock2D"],
                 up_block_types=["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
                 cross_attention_dim=768, attention_head_dim=8)
# ComfyUI's published configs (comfy.supported_models) the folder must be read as
PUBLISHED = {"sdxl": ("SDXL", SDXL_UNET), "sd15": ("SD15", SD15_UNET)}


def _diffusers_unet(config: dict) -> dict:
    """diffusers' UNet of ``config`` as its folder's state dict, on the meta device (no memory)."""
    diffusers = pytest.importorskip("diffusers")
    import torch

    from pipetrain.backend.runtime import ensure_comfyui
    ensure_comfyui()
    with torch.device("meta"):
        return diffusers.UNet2DConditionModel(**config).state_dict()


@pytest.fixture
def meta_folder(tmp_path, monkeypatch):
    """A UNet folder whose shards are ``sd`` (meta tensors): the loaders' two file readers answer with it."""
    from pipetrain.backend.models import loading

    def _folder(sd: dict):
        folder = tmp_path / "unet"
        folder.mkdir()
        monkeypatch.setattr(loading, "read_header", lambda path: ({k: tuple(v.shape) for k, v in sd.items()}, {}))
        monkeypatch.setattr(loading, "_load_state_dict", lambda path: (dict(sd), {}))
        return folder
    return _folder


def _shapes(sd: dict) -> dict:
    return {k: tuple(v.shape) for k, v in sd.items()}


@pytest.mark.parametrize("arch", list(PUBLISHED))
def test_a_published_diffusers_unet_converts_to_comfyuis_unet_key_for_key(arch, meta_folder):
    import torch

    from pipetrain.backend.models.loading import build_model, comfy_layout, detect_architecture
    config_name, unet = PUBLISHED[arch]
    sd = _diffusers_unet(unet)
    import comfy.supported_models as sm
    folder = meta_folder(sd)
    assert detect_architecture(folder) == arch
    unet_config, converted = comfy_layout(dict(sd))
    published = getattr(sm, config_name).unet_config
    assert {k: unet_config[k] for k in published} == published
    expected = _shapes(build_model(arch, unet_config, torch.bfloat16, "meta").model.diffusion_model.state_dict())
    assert _shapes(converted) == expected
    assert len(converted) == len(sd)   # every tensor of the folder has its place in ComfyUI's UNet


@pytest.mark.parametrize("arch", list(PUBLISHED))
def test_comfyuis_loader_builds_the_published_unet_from_the_folder(arch, meta_folder, monkeypatch, caplog):
    """PipeTrain's ``load_diffusion_model`` on the folder (ComfyUI's ``load_diffusion_model_state_dict`` inside),
    built on the meta device: ComfyUI's UNet with every weight given and no key of the folder left over."""
    import torch

    from pipetrain.backend.models.loading import build_model, comfy_layout, load_diffusion_model
    sd = _diffusers_unet(PUBLISHED[arch][1])
    import comfy.model_management as mm
    folder = meta_folder(sd)
    monkeypatch.setattr(mm, "unet_offload_device", lambda: torch.device("meta"))   # ComfyUI moves it there
    import comfy.sd
    real, given = comfy.sd.load_diffusion_model_state_dict, {}

    def spy(state_dict, **kwargs):
        given["sd"] = state_dict
        return real(state_dict, **kwargs)
    monkeypatch.setattr(comfy.sd, "load_diffusion_model_state_dict", spy)
    with caplog.at_level(logging.WARNING), torch.device("meta"):
        patcher = load_diffusion_model(folder, torch.bfloat16, arch=arch)
    assert not given["sd"]   # ComfyUI pops each key it converts: none of the folder's is left over
    assert not [r.message for r in caplog.records if r.message.startswith(("unet missing", "unet unexpected"))]
    loaded = _shapes(patcher.model.diffusion_model.state_dict())
    unet_config, _ = comfy_layout(dict(sd))
    assert loaded == _shapes(build_model(arch, unet_config, torch.bfloat16, "meta").model.diffusion_model.state_dict())


@pytest.mark.parametrize("arch", list(PUBLISHED))
def test_the_config_reads_the_unet_folder_of_a_diffusers_pipeline(arch, tmp_path):
    """diffusion-pipe's SDXL table (``checkpoint_path``) and an SD1.5 ``diffusers_path``: the folder's unet/, vae/
    and text encoders, in order."""
    import json

    import torch
    from safetensors.torch import save_file

    from pipetrain.backend.config import load_run_config
    folder = tmp_path / "pipeline"
    for sub in ("unet", "vae", "text_encoder", *(["text_encoder_2"] if arch == "sdxl" else [])):
        (folder / sub).mkdir(parents=True)
        save_file({"w": torch.zeros(2)}, str(folder / sub / "model.safetensors"))
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    key = "checkpoint_path" if arch == "sdxl" else "diffusers_path"
    (tmp_path / "run.toml").write_text(f"output_dir = 'out'\ndataset = 'dataset.toml'\n[model]\ntype = '{arch}'\n"
                                       f"{key} = 'pipeline'\n")
    (tmp_path / "dataset.toml").write_text("[[directory]]\npath = 'images'\n")
    model = load_run_config(tmp_path / "run.toml").model
    assert (model.diffusion_model, model.vae) == ("pipeline/unet", "pipeline/vae")
    assert model.text_encoder_files == ["pipeline/text_encoder", *(["pipeline/text_encoder_2"] if arch == "sdxl"
                                                                     else [])]
