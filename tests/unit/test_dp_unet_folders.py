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
exactly those of ComfyUI's UNet for the published config, with nothing missing and nothing left over. The folder's
other parts (SDXL's VAE and its two CLIP folders) are compared with the networks diffusers and transformers run from
the same folder.
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

    from pipetrain.backend.host.runtime import ensure_comfyui
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


@pytest.fixture(scope="module")
def sdxl_pipeline(tmp_path_factory):
    """An SDXL pipeline folder whose VAE is SDXL's at its published widths and whose CLIP-L and OpenCLIP bigG are
    their published widths with three layers (ComfyUI reads their sizes from config.json); the UNet is a placeholder
    (its conversion: the tests above)."""
    pytest.importorskip("diffusers")
    import json

    import diffusers
    import torch
    import transformers
    from safetensors.torch import save_file

    from pipetrain.bench.diffusion_pipe_models import (CLIP_L, OPENCLIP_BIGG, SDXL_VAE, _write_diffusers_component,
                                                       _write_transformers_component)
    folder = tmp_path_factory.mktemp("sdxl") / "stable-diffusion-xl-base-1.0"
    (folder / "unet").mkdir(parents=True)
    save_file({"w": torch.zeros(2)}, str(folder / "unet" / "diffusion_pytorch_model.safetensors"))
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    _write_diffusers_component(folder / "vae", diffusers.AutoencoderKL, SDXL_VAE, "cpu")
    for sub, cls, config in (("text_encoder", transformers.CLIPTextModel, CLIP_L),
                             ("text_encoder_2", transformers.CLIPTextModelWithProjection, OPENCLIP_BIGG)):
        small = transformers.CLIPTextConfig(**{**config, "num_hidden_layers": 3, "intermediate_size": 64})
        _write_transformers_component(folder / sub, cls, small, "cpu")
    return folder


@pytest.mark.slow   # writes and reads SDXL's VAE at its published widths (about 25 s on 2 cores)
def test_an_sdxl_folders_vae_and_text_encoders_are_the_networks_diffusers_and_transformers_run(sdxl_pipeline,
                                                                                               tmp_path):
    """diffusion-pipe's SDXL table (checkpoint_path = the pipeline folder): ComfyUI's VAE from vae/ encodes as
    diffusers' AutoencoderKL of the same folder, and its SDXL CLIP from text_encoder*/ gives transformers' hidden
    states (penultimate layer, side by side) and OpenCLIP bigG's projected pooled output."""
    import diffusers
    import torch
    import transformers

    from pipetrain.backend.config import load_run_config
    from pipetrain.backend.models.registry import adapter_class
    (tmp_path / "run.toml").write_text(f"output_dir = 'out'\ndataset = 'dataset.toml'\n[model]\ntype = 'sdxl'\n"
                                       f"checkpoint_path = '{sdxl_pipeline}'\ndtype = 'float32'\n")
    (tmp_path / "dataset.toml").write_text("[[directory]]\npath = 'images'\n")
    cfg = load_run_config(tmp_path / "run.toml")
    adapter = adapter_class("sdxl")(cfg.model, cfg.resolve)

    vae = adapter.load_vae()
    image = torch.rand(1, 64, 64, 3, generator=torch.Generator().manual_seed(0))
    ours = vae.encode(image)                                   # ComfyUI: the latent mean, unscaled
    reference = diffusers.AutoencoderKL.from_pretrained(sdxl_pipeline / "vae", torch_dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = reference.encode(image.movedim(-1, 1) * 2 - 1).latent_dist.mean
    del reference
    assert ours.shape == theirs.shape == (1, 4, 8, 8)
    assert (ours.float() - theirs).abs().max() < 1e-3 * theirs.abs().max()

    clip = adapter.load_text_encoders()
    tokens = clip.tokenize("a red circle")
    cond, pooled = clip.encode_from_tokens(tokens, return_pooled=True)
    assert cond.shape[-1] == 768 + 1280
    for part, (sub, cls, key) in enumerate((("text_encoder", transformers.CLIPTextModel, "l"),
                                            ("text_encoder_2", transformers.CLIPTextModelWithProjection, "g"))):
        model = cls.from_pretrained(sdxl_pipeline / sub, torch_dtype=torch.float32).eval()
        ids = torch.tensor([[token for token, *_ in tokens[key][0]]])
        with torch.no_grad():
            out = model(ids, output_hidden_states=True)
        width = slice(0, 768) if part == 0 else slice(768, 2048)
        assert (cond[0, :, width] - out.hidden_states[-2][0]).abs().max() < 1e-3
        if part == 1:
            assert (pooled[0] - out.text_embeds[0]).abs().max() < 1e-3
