"""The model files bench/diffusion_pipe.py writes for diffusion-pipe: tiny Flux and SDXL folders load as diffusers
pipelines and run, the full SDXL configs are SDXL base's, Z-Image's configs name files that exist, and the two
loading shims inside diffusion-pipe's process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SDXL_BASE_UNET_PARAMETERS = 2_567_463_684


def _comfyui() -> Path:
    from pipetrain.backend.runtime import locate_comfyui
    return locate_comfyui()


def _as_json(config: dict) -> dict:
    """A loaded config as written (diffusers may hold its lists as tuples)."""
    return json.loads(json.dumps(config))


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """``tiny_folder(arch)``: the arch's tiny model folder, written once for this module."""
    from pipetrain.bench.diffusion_pipe_models import model_folder, write_model_folder

    root = tmp_path_factory.mktemp("dp-models")

    def folder(arch: str) -> Path:
        write_model_folder(arch, model_folder(arch, root, "tiny"), "tiny", _comfyui())
        return model_folder(arch, root, "tiny")
    return folder


def test_tiny_flux_folder_loads_as_a_flux_pipeline_and_its_transformer_runs(tiny_folder):
    diffusers = pytest.importorskip("diffusers")
    import torch

    from pipetrain.bench.diffusion_pipe_models import FLUX_TINY

    pipe = diffusers.FluxPipeline.from_pretrained(tiny_folder("flux"), torch_dtype=torch.float32)
    transformer = pipe.transformer
    assert _as_json({k: transformer.config[k] for k in FLUX_TINY}) == FLUX_TINY
    image_tokens, text_tokens = 16, 8
    with torch.no_grad():
        out = transformer(hidden_states=torch.randn(1, image_tokens, 64),
                          encoder_hidden_states=torch.randn(1, text_tokens, 4096),
                          pooled_projections=torch.randn(1, 768), timestep=torch.tensor([0.5]),
                          img_ids=torch.zeros(image_tokens, 3), txt_ids=torch.zeros(text_tokens, 3),
                          guidance=torch.tensor([3.5])).sample
    assert out.shape == (1, image_tokens, 64) and torch.isfinite(out).all()


def test_tiny_sdxl_folder_loads_as_an_sdxl_pipeline_and_its_unet_reads_the_encoders_output(tiny_folder):
    """The UNet runs on what the written text encoders give (penultimate states side by side, bigG's pooled
    projection and six time ids), as diffusion-pipe's SDXL feeds it."""
    diffusers = pytest.importorskip("diffusers")
    import torch

    from pipetrain.bench.diffusion_pipe_models import sdxl_configs

    pipe = diffusers.StableDiffusionXLPipeline.from_pretrained(tiny_folder("sdxl"), torch_dtype=torch.float32,
                                                               add_watermarker=False)
    expected = sdxl_configs("tiny")["unet"]
    assert _as_json({k: pipe.unet.config[k] for k in expected}) == expected
    assert pipe.tokenizer.model_max_length == pipe.tokenizer_2.model_max_length == 77
    ids = pipe.tokenizer("a red circle", return_tensors="pt").input_ids
    with torch.no_grad():
        clip_l = pipe.text_encoder(ids, output_hidden_states=True)
        big_g = pipe.text_encoder_2(ids, output_hidden_states=True)
        states = torch.cat([clip_l.hidden_states[-2], big_g.hidden_states[-2]], dim=-1)
        time_ids = torch.tensor([[64.0, 64.0, 0.0, 0.0, 64.0, 64.0]])
        out = pipe.unet(torch.randn(1, 4, 8, 8), torch.tensor([500]), states,
                        added_cond_kwargs={"text_embeds": big_g.text_embeds, "time_ids": time_ids}).sample
    assert out.shape == (1, 4, 8, 8) and torch.isfinite(out).all()


def test_sdxl_text_encoders_are_written_whole(tiny_folder):
    pytest.importorskip("diffusers")
    import transformers

    folder = tiny_folder("sdxl")
    for sub, cls in (("text_encoder", transformers.CLIPTextModel),
                     ("text_encoder_2", transformers.CLIPTextModelWithProjection)):
        _, info = cls.from_pretrained(folder / sub, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (sub, info)


def test_full_sdxl_configs_build_sdxl_base_unet():
    diffusers = pytest.importorskip("diffusers")
    import torch
    import transformers

    from pipetrain.bench.diffusion_pipe_models import sdxl_configs

    configs = sdxl_configs("full")
    with torch.device("meta"):
        unet = diffusers.UNet2DConditionModel(**configs["unet"])
        big_g = transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(**configs["text_encoder_2"]))
    assert sum(p.numel() for p in unet.parameters()) == SDXL_BASE_UNET_PARAMETERS
    assert configs["unet"]["cross_attention_dim"] == (configs["text_encoder"]["hidden_size"]
                                                      + configs["text_encoder_2"]["hidden_size"])
    assert big_g.config.num_hidden_layers == 32 and big_g.text_projection.out_features == 1280


def test_sdxl_caption_stays_in_one_clip_chunk_as_diffusion_pipe_tokenizes_it(tmp_path):
    """diffusion-pipe tokenizes without special tokens or truncation and splits into chunks of
    model_max_length - 2 (BOS and EOS added per chunk): the bench caption must fit 75 tokens."""
    import transformers

    from pipetrain.bench.diffusion_pipe_models import write_clip_tokenizer
    from pipetrain.bench.run import bench_caption

    write_clip_tokenizer(tmp_path, _comfyui())
    tokenizer = transformers.CLIPTokenizer.from_pretrained(tmp_path)
    ids = tokenizer(bench_caption("sdxl"), truncation=False, add_special_tokens=False).input_ids
    assert len(ids) <= tokenizer.model_max_length - 2


def test_tiny_zimage_write_only_names_existing_files_without_diffusers(tmp_path):
    """The Z-Image path writes ComfyUI files and configs with no diffusers at all (an import of it fails here)."""
    blocker = tmp_path / "blocker" / "diffusers"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('the Z-Image path must not import diffusers')\n")
    env = {**os.environ, "COMFYUI_PATH": str(_comfyui()),
           "PYTHONPATH": os.pathsep.join([str(blocker.parent), os.environ.get("PYTHONPATH", "")])}
    work, out = tmp_path / "work", tmp_path / "out"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "diffusion_pipe.py"), "--size", "tiny", "--write-only",
                          "--cases", "zimage-1024-b4-ckpt", "--resolution", "64", "--work", str(work),
                          "--out", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    main = tomllib.loads((work / "zimage-1024-b4-ckpt" / "main.toml").read_text())
    model = main["model"]
    assert model["type"] == "z_image" and main["activation_checkpointing"] is True
    (text_encoder,) = model["text_encoders"]
    assert text_encoder["type"] == "lumina2"
    for path in (model["diffusion_model"], model["vae"], text_encoder["path"]):
        assert Path(path).is_file(), path


def test_from_single_file_of_a_folder_loads_it_with_from_pretrained(tiny_folder, monkeypatch):
    diffusers = pytest.importorskip("diffusers")
    import torch

    from pipetrain.bench.diffusion_pipe import load_sdxl_folders_with_from_pretrained

    pipeline = diffusers.StableDiffusionXLPipeline
    monkeypatch.setattr(pipeline, "from_single_file", pipeline.from_single_file)   # undone after the test
    load_sdxl_folders_with_from_pretrained()
    pipe = pipeline.from_single_file(str(tiny_folder("sdxl")), torch_dtype=torch.bfloat16, add_watermarker=False)
    assert isinstance(pipe, pipeline) and pipe.unet.dtype == torch.bfloat16 and pipe.watermark is None


def test_a_keyword_the_installed_function_lacks_is_dropped():
    from pipetrain.bench.diffusion_pipe import drop_keyword_where_unknown

    module = types.ModuleType("loaders")
    module.old = lambda path, model_options=None: (path, model_options)
    module.new = lambda path, disable_dynamic=False: (path, disable_dynamic)
    for name in ("old", "new"):
        drop_keyword_where_unknown(module, name, "disable_dynamic")
    assert module.old("m.safetensors", model_options={}, disable_dynamic=True) == ("m.safetensors", {})
    assert module.new("m.safetensors", disable_dynamic=True) == ("m.safetensors", True)
