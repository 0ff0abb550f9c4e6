"""The model files bench/diffusion_pipe.py writes for diffusion-pipe: tiny Flux and SDXL folders load as diffusers
pipelines and run, the full SDXL configs are SDXL base's, Z-Image's configs name files that exist, Qwen-Image's and
Wan's files hold every tensor diffusion-pipe's loaders set (tiny ones loaded, full ones checked on the meta
device), Wan's clips and configs, and the two loading shims inside diffusion-pipe's process."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SDXL_BASE_UNET_PARAMETERS = 2_567_463_684
# the diffusion-pipe checkout bench/diffusion_pipe.py runs (git-ignored: absent, its tests skip)
DP_CHECKOUT = REPO / ".carry" / "diffusion-pipe"
QWEN_IMAGE_CONFIGS = DP_CHECKOUT / "configs" / "qwen_image"
WAN_1_3B = {"model_type": "t2v", "dim": 1536, "ffn_dim": 8960, "num_heads": 12, "num_layers": 30, "in_dim": 16,
            "out_dim": 16}


def _comfyui() -> Path:
    from pipetrain.backend.host.runtime import locate_comfyui
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


# --- Qwen-Image ----------------------------------------------------------------------------------------
def _diffusion_pipe_text_encoder_key(file_key: str) -> str:
    """The name diffusion-pipe's qwen_image.py sets a text-encoder file tensor under: the checkpoint's language model
    ``model.*`` goes under ``model.language_model``, ``visual.*`` under ``model``, and the head stays."""
    return "lm_head.weight" if "lm_head" in file_key else "model." + file_key.replace("model.", "language_model.")


def _set_every_tensor(module, file: Path, rename=lambda key: key) -> None:
    """diffusion-pipe's route into a module built with empty weights: each file tensor set in place."""
    from accelerate.utils import set_module_tensor_to_device
    from safetensors import safe_open

    with safe_open(str(file), "pt") as f:
        for key in f.keys():
            set_module_tensor_to_device(module, rename(key), device="cpu", value=f.get_tensor(key))


def _meta_left(module) -> list[str]:
    return [name for name, p in module.named_parameters() if p.is_meta]


def test_tiny_qwen_image_folder_loads_the_way_diffusion_pipe_loads_it(tiny_folder):
    """Each component built empty from its config, then every file tensor set: no parameter is left on meta."""
    diffusers = pytest.importorskip("diffusers")
    import transformers
    from accelerate import init_empty_weights

    folder = tiny_folder("qwen_image")
    for sub, cls in (("transformer", diffusers.QwenImageTransformer2DModel),
                     ("vae", diffusers.AutoencoderKLQwenImage)):
        with init_empty_weights():
            module = cls.from_config(json.loads((folder / sub / "config.json").read_text()))
        _set_every_tensor(module, folder / sub / "diffusion_pytorch_model.safetensors")
        assert not _meta_left(module), sub
    with init_empty_weights():
        text_encoder = transformers.Qwen2_5_VLForConditionalGeneration(
            transformers.Qwen2_5_VLConfig.from_pretrained(folder / "text_encoder"))
    _set_every_tensor(text_encoder, folder / "text_encoder" / "model.safetensors", _diffusion_pipe_text_encoder_key)
    assert not _meta_left(text_encoder)


@pytest.mark.skipif(not QWEN_IMAGE_CONFIGS.is_dir(), reason="no diffusion-pipe checkout with configs/qwen_image")
def test_full_qwen_image_files_hold_every_tensor_diffusion_pipe_sets():
    """The full-size files' tensors (meta: nothing written), under diffusion-pipe's names, are exactly the
    parameters of the modules it builds from its own configs, shape for shape."""
    diffusers = pytest.importorskip("diffusers")
    import transformers
    from accelerate import init_empty_weights

    from pipetrain.bench.diffusion_pipe_models import qwen_image_modules

    ours = qwen_image_modules("full")
    with init_empty_weights():
        theirs = {sub: cls.from_config(json.loads((QWEN_IMAGE_CONFIGS / sub / "config.json").read_text()))
                  for sub, cls in (("transformer", diffusers.QwenImageTransformer2DModel),
                                   ("vae", diffusers.AutoencoderKLQwenImage))}
        theirs["text_encoder"] = transformers.Qwen2_5_VLForConditionalGeneration(
            transformers.Qwen2_5_VLConfig.from_pretrained(QWEN_IMAGE_CONFIGS / "text_encoder", local_files_only=True))
    for sub, module in theirs.items():
        rename = _diffusion_pipe_text_encoder_key if sub == "text_encoder" else (lambda key: key)
        written = {rename(key): tuple(t.shape) for key, t in ours[sub].state_dict().items()}
        assert written == {name: tuple(p.shape) for name, p in module.named_parameters()}, sub


# --- Wan ----------------------------------------------------------------------------------------------
def _run_check(script: str, request: dict) -> dict:
    """``tests/<script>`` (diffusion_pipe_wan_check.py, diffusion_pipe_hunyuan_check.py) in a subprocess with
    diffusion-pipe's checkout importable."""
    env = {**os.environ, "DIFFUSION_PIPE": str(DP_CHECKOUT),
           "PYTHONPATH": os.pathsep.join([str(DP_CHECKOUT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, str(REPO / "tests" / script)],
                         input=json.dumps(request), env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


def _run_wan_check(request: dict) -> dict:
    return _run_check("diffusion_pipe_wan_check.py", request)


@pytest.mark.skipif(not DP_CHECKOUT.is_dir(), reason="no diffusion-pipe checkout")
def test_tiny_wan_folder_loads_with_diffusion_pipes_wan_code(tiny_folder):
    """Its transformer, UMT5 encoder (ComfyUI keys, its own mapping, strict), VAE (.pth) and the stand-in tokenizer:
    512 valid ids ending in T5's end token, which the encoder reads."""
    pytest.importorskip("diffusers")
    from pipetrain.backend.models.vaes import WAN21_VAE_DIM
    from pipetrain.bench.run import bench_caption

    folder = tiny_folder("wan")
    model = json.loads((folder / "written.json").read_text())["model"]
    caption = bench_caption("wan")
    result = _run_wan_check({"mode": "load", "ckpt": model["ckpt_path"], "transformer": model["transformer_path"],
                             "llm": model["llm_path"], "vae_dim": WAN21_VAE_DIM["tiny"], "caption": caption})
    assert result["meta_left"] == []
    assert result["ids_shape"] == [1, 512] and result["ends"] == 1 and result["tokens"] == len(caption.split()) + 1
    assert 2 < result["ids_max"] < 256384
    assert result["context_shape"] == [1, 512, 4096] and result["context_finite"]


@pytest.mark.skipif(not DP_CHECKOUT.is_dir(), reason="no diffusion-pipe checkout")
def test_full_wan_1_3b_files_hold_what_diffusion_pipe_loads():
    """The 1.3B config.json picks diffusion-pipe's t2v 1.3B config, and files with the full-size tensors (meta:
    nothing written) load by its route: every transformer parameter, the strict full UMT5-XXL and VAE loads."""
    pytest.importorskip("diffusers")
    from pipetrain.backend.models.registry import arch_spec
    from pipetrain.backend.models.tiny import build_text_encoder, build_vae, text_encoder_config
    from pipetrain.bench.diffusion_pipe_models import wan_checkpoint_config, wan_unet_config

    unet_config = wan_unet_config("full", "wan-1.3b")
    config = wan_checkpoint_config(unet_config)
    assert {key: config[key] for key in WAN_1_3B} == WAN_1_3B and config["text_len"] == 512

    def shapes(module) -> dict:
        return {key: list(t.shape) for key, t in module.state_dict().items()}

    _run_wan_check({"mode": "keys", "config": config, "transformer": shapes(arch_spec("wan").build(unet_config)),
                    "text_encoder": shapes(build_text_encoder("umt5xxl", text_encoder_config("umt5xxl", "full"))),
                    "vae": shapes(build_vae("wan", "full"))})


WRITE_ONLY_FRAMES = 9


@pytest.fixture(scope="module")
def written_cases(tmp_path_factory):
    """The work folder of one ``bench/diffusion_pipe.py --write-only`` run of the four cases the two write-only tests
    read (they only read it): one interpreter's imports, and Wan's tiny folder written once for both Wan cases, as
    the CLI does for any cases of one run."""
    pytest.importorskip("diffusers")
    pytest.importorskip("av")
    root = tmp_path_factory.mktemp("dp-write-only")
    env = {**os.environ, "COMFYUI_PATH": str(_comfyui())}
    work, out = root / "work", root / "out"
    cases = "qwen_image-1024-ckpt,wan1.3b-480x832x81-ckpt,wan14b-480x832x33-ckpt,hunyuan_video-544x960x33-ckpt"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "diffusion_pipe.py"), "--size", "tiny", "--write-only",
                          "--cases", cases, "--resolution", "32", "--frames", str(WRITE_ONLY_FRAMES), "--work",
                          str(work), "--out", str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return work


def test_tiny_qwen_image_and_wan_write_only_configs_and_wan_clips(written_cases):
    """The CLI writes both cases; Wan's dataset is MP4 clips of the asked frames at Wan's 16 fps in one frame
    bucket of that length."""
    av = pytest.importorskip("av")

    work, frames = written_cases, WRITE_ONLY_FRAMES
    qwen = tomllib.loads((work / "qwen_image-1024-ckpt" / "main.toml").read_text())["model"]
    assert qwen["type"] == "qwen_image" and Path(qwen["diffusers_path"], "text_encoder", "model.safetensors").is_file()
    wan_dir = work / "wan1.3b-480x832x81-ckpt"
    wan = tomllib.loads((wan_dir / "main.toml").read_text())["model"]
    assert wan["type"] == "wan" and Path(wan["ckpt_path"], "Wan2.1_VAE.pth").is_file()
    dataset = tomllib.loads((wan_dir / "dataset.toml").read_text())
    assert dataset["frame_buckets"] == [frames] and dataset["resolutions"] == [32]
    clips = sorted(Path(dataset["directory"][0]["path"]).glob("*.mp4"))
    assert len(clips) == 8
    with av.open(str(clips[0])) as container:
        stream = container.streams.video[0]
        decoded = list(container.decode(stream))
        assert stream.average_rate == 16 and len(decoded) == frames and decoded[0].width == 32


WAN_ATTENTION_CHECK = """
import json, math, torch
import models  # diffusion-pipe's package, bound before ours is imported
from pipetrain.bench.diffusion_pipe import wan_attention_through_sdpa_without_flash_attn
wan_attention_through_sdpa_without_flash_attn()
from models.wan import model
torch.manual_seed(0)
q, k, v = (torch.randn(1, 16, 4, 8) for _ in range(3))
out = model.flash_attention(q=q, k=k, v=v, k_lens=torch.tensor([16]), window_size=(-1, -1))
weights = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(8), dim=-1)
ref = torch.einsum("bhqk,bkhd->bqhd", weights, v)
print(json.dumps({"dtype": str(out.dtype), "shape": list(out.shape), "err": (out - ref).abs().max().item()}))
"""


@pytest.mark.skipif(not DP_CHECKOUT.is_dir(), reason="no diffusion-pipe checkout")
def test_wan_attention_runs_through_sdpa_where_flash_attn_is_missing():
    """diffusion-pipe's Wan asserts flash-attn is installed; the GPU machine has no wheel for it, so the bench routes
    its calls to the SDPA branch of Wan's own attention: attention over [batch, tokens, heads, dim], the caller's
    dtype back."""
    pytest.importorskip("diffusers")
    if importlib.util.find_spec("flash_attn"):
        pytest.skip("flash-attn is installed: diffusion-pipe's Wan uses it")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(DP_CHECKOUT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", WAN_ATTENTION_CHECK], env=env, cwd=DP_CHECKOUT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["dtype"] == "torch.float32" and result["shape"] == [1, 16, 4, 8]
    assert result["err"] < 0.03      # bf16 inside, as flash-attn computes


# --- Wan 2.1 14B and HunyuanVideo (issue #27) ----------------------------------------------------------
WAN_14B = {"model_type": "t2v", "dim": 5120, "ffn_dim": 13824, "num_heads": 40, "num_layers": 40, "in_dim": 16,
           "out_dim": 16}


@pytest.mark.skipif(not DP_CHECKOUT.is_dir(), reason="no diffusion-pipe checkout")
def test_full_wan_14b_files_hold_what_diffusion_pipe_loads():
    """The case's Wan (no variant) is 2.1 T2V 14B: its config.json holds the 14B's fields, and files with the 14B
    transformer's tensors, the full UMT5-XXL and VAE load by diffusion-pipe's route (meta: nothing written)."""
    pytest.importorskip("diffusers")
    from pipetrain.backend.models.registry import arch_spec
    from pipetrain.backend.models.tiny import build_text_encoder, build_vae, text_encoder_config
    from pipetrain.bench.diffusion_pipe_models import wan_checkpoint_config, wan_unet_config
    from pipetrain.bench.run import CASES

    case = CASES["wan14b-480x832x33-ckpt"]
    unet_config = wan_unet_config("full", case.variant)
    config = wan_checkpoint_config(unet_config)
    assert {key: config[key] for key in WAN_14B} == WAN_14B

    def shapes(module) -> dict:
        return {key: list(t.shape) for key, t in module.state_dict().items()}

    _run_wan_check({"mode": "keys", "config": config, "transformer": shapes(arch_spec("wan").build(unet_config)),
                    "text_encoder": shapes(build_text_encoder("umt5xxl", text_encoder_config("umt5xxl", "full"))),
                    "vae": shapes(build_vae("wan", "full"))})


def _run_hunyuan_check(request: dict) -> dict:
    return _run_check("diffusion_pipe_hunyuan_check.py", request)


@pytest.mark.skipif(not DP_CHECKOUT.is_dir(), reason="no diffusion-pipe checkout")
def test_tiny_hunyuan_video_files_load_with_diffusion_pipes_hunyuan_code(tiny_folder):
    """Its HunyuanVideoPipeline built from the written [model] section: the VAE (strict, its class), the Llama and
    CLIP-L folders through transformers with every parameter from the files, the tokenizers; its
    load_diffusion_model sets every transformer parameter from the ComfyUI-layout file; the caption encodes to
    its 256 text positions, all of it inside them (not cut), and CLIP-L's pooled 768."""
    pytest.importorskip("diffusers")
    from pipetrain.backend.models.hunyuan_video import HV_CONFIGS
    from pipetrain.bench.diffusion_pipe_models import HUNYUAN_VAE_TINY
    from pipetrain.bench.run import bench_caption

    folder = tiny_folder("hunyuan_video")
    model = json.loads((folder / "written.json").read_text())["model"]
    assert model["type"] == "hunyuan-video"
    c = HV_CONFIGS["tiny"]
    tiny = {"mm_double_blocks_depth": c["depth"], "mm_single_blocks_depth": c["depth_single_blocks"],
            "rope_dim_list": c["axes_dim"], "hidden_size": c["hidden_size"], "heads_num": c["num_heads"],
            "mlp_width_ratio": 4, "guidance_embed": True, "text_states_dim": c["context_in_dim"]}
    result = _run_hunyuan_check({"mode": "load", "model": {k: v for k, v in model.items() if k != "dtype"},
                                 "transformer": tiny, "vae": HUNYUAN_VAE_TINY,
                                 "caption": bench_caption("hunyuan_video")})
    assert result["meta_left"] == [] and result["llm_not_from_file"] == [] and result["clip_not_from_file"] == []
    assert (result["double_blocks"], result["single_blocks"]) == (c["depth"], c["depth_single_blocks"])
    assert result["llm_shape"] == [1, 256, c["context_in_dim"]] and result["llm_finite"]
    assert 240 < result["llm_tokens"] < 256
    assert result["clip_shape"] == [1, 768] and result["vae_latent_channels"] == 16


@pytest.mark.skipif(not DP_CHECKOUT.is_dir(), reason="no diffusion-pipe checkout")
def test_full_hunyuan_video_files_hold_what_diffusion_pipe_loads():
    """Full size on the meta device (nothing written): every parameter of diffusion-pipe's 13B transformer comes from
    the file's ComfyUI-layout tensors through its own key conversion, transformers' Llama (32 layers) and CLIP-L
    from the folders' configs find every parameter in the files, and the VAE file's tensors are those its class
    loads strictly from its config."""
    pytest.importorskip("diffusers")
    from pipetrain.backend.models.tiny import text_encoder_config
    from pipetrain.bench.diffusion_pipe_models import hunyuan_dp_vae, hunyuan_llama_config, hunyuan_video_modules

    def shapes(module) -> dict:
        return {key: list(t.shape) for key, t in module.state_dict().items()}

    files = {sub: shapes(module) for sub, (module, _) in hunyuan_video_modules("full").items()}
    result = _run_hunyuan_check({"mode": "keys", **files, "vae": shapes(hunyuan_dp_vae("full")),
                                 "llm_config": hunyuan_llama_config("full").to_dict(),
                                 "clip_config": text_encoder_config("clip_l", "full")})
    assert result["transformer_unmatched"] == [] and result["transformer_parameters"] > 800
    assert result["llm_layers"] == 32 and result["llm_unmatched"] == [] and result["clip_unmatched"] == []
    assert result["vae_matches"]


def test_tiny_wan14b_and_hunyuan_video_write_only(written_cases):
    """The CLI writes both cases: Wan's 14B case in the Wan folder layout, HunyuanVideo's four ComfyUI-format paths;
    HunyuanVideo's clips are MP4s at its 24 fps in one frame bucket; each folder names the files PipeTrain trains
    the case on, in the folder."""
    av = pytest.importorskip("av")
    from pipetrain.bench.diffusion_pipe_models import pipetrain_files

    work, frames = written_cases, WRITE_ONLY_FRAMES
    wan = tomllib.loads((work / "wan14b-480x832x33-ckpt" / "main.toml").read_text())
    assert wan["model"]["type"] == "wan" and wan["activation_checkpointing"] is True
    main = tomllib.loads((work / "hunyuan_video-544x960x33-ckpt" / "main.toml").read_text())
    model = main["model"]
    assert model["type"] == "hunyuan-video" and main["adapter"]["rank"] == 32
    assert Path(model["transformer_path"]).is_file() and Path(model["vae_path"]).is_file()
    for sub in ("llm_path", "clip_path"):
        written = {p.name for p in Path(model[sub]).iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= written
    dataset = tomllib.loads((work / "hunyuan_video-544x960x33-ckpt" / "dataset.toml").read_text())
    assert dataset["frame_buckets"] == [frames]
    clips = sorted(Path(dataset["directory"][0]["path"]).glob("*.mp4"))
    with av.open(str(clips[0])) as container:
        assert container.streams.video[0].average_rate == 24 and len(list(container.decode(video=0))) == frames
    for arch in ("wan", "hunyuan_video"):
        folder = work / f"{arch}-dp-tiny"
        files = pipetrain_files(folder)
        paths = [Path(files["diffusion_model"]), Path(files["vae"]), *map(Path, files["text_encoders"])]
        assert all(p.is_file() and p.parent.is_relative_to(folder) for p in paths), files
    assert Path(pipetrain_files(work / "hunyuan_video-dp-tiny")["diffusion_model"]) == Path(model["transformer_path"])


def test_a_case_beside_diffusion_pipe_trains_on_its_files_after_freeing_other_models(tmp_path):
    """run.py with diffusion-pipe: the case's files are diffusion-pipe's, written once, where PipeTrain reads them,
    and the full-size files of other models under the work root go first (the other case's, run.py's own)."""
    pytest.importorskip("diffusers")
    from types import SimpleNamespace

    from pipetrain.bench.run import CASES, case_models

    for stale in ("wan-dp-full", "wan-full", "flux-full", "wan-dp-full-wan-1.3b", "wan-full-wan-1.3b"):
        (tmp_path / stale).mkdir()
    for marker in ("flux-full.json", "wan-full-wan-1.3b.json"):
        (tmp_path / marker).write_text("{}")
    args = SimpleNamespace(size="tiny", steps=3, resolution=64, frames=9)
    files, freed = case_models("hunyuan_video-544x960x33-ckpt", CASES["hunyuan_video-544x960x33-ckpt"], tmp_path,
                               args, _comfyui(), with_dp=True)
    assert sorted(freed) == ["flux-full", "flux-full.json", "wan-dp-full", "wan-dp-full-wan-1.3b", "wan-full",
                             "wan-full-wan-1.3b", "wan-full-wan-1.3b.json"]
    folder = tmp_path / "hunyuan_video-dp-tiny"
    assert files["diffusion_model"] == str(folder / "transformer.safetensors")
    assert files["text_encoders"] == [str(folder / sub / "model.safetensors") for sub in ("llm", "clip")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hunyuan_video-544x960x33-ckpt", "hunyuan_video-dp-tiny"]


@pytest.mark.slow
def test_pipetrain_trains_on_the_hunyuan_video_files_written_for_diffusion_pipe(tiny_folder, tmp_path,
                                                                                warm_bench_ranks):
    """Our side of the HunyuanVideo case on the shared tiny files (the transformer in ComfyUI's saved layout, the
    Llama and CLIP-L files of diffusion-pipe's folders, ComfyUI's VAE), on CPU ranks (forked from the warm ranks)."""
    pytest.importorskip("diffusers")
    from pipetrain.bench.diffusion_pipe_models import pipetrain_files
    from pipetrain.bench.run import CASES, run_ours

    name = "hunyuan_video-544x960x33-ckpt"
    result = run_ours(name, CASES[name], pipetrain_files(tiny_folder("hunyuan_video")), tmp_path, 3, 1,
                      resolution=64, frames=9)
    assert result["rc"] == 0 and result["steps_measured"] == 2, result.get("log_tail")


def test_varlen_attention_through_sdpa_attends_within_each_stretch():
    """flash-attn's varlen semantics: tokens attend only inside their stretch of cu_seqlens (HunyuanVideo's image +
    real text, then its text padding); against a block-diagonal masked softmax."""
    import math

    import torch

    from pipetrain.bench.diffusion_pipe import varlen_attention_through_sdpa

    torch.manual_seed(0)
    q, k, v = (torch.randn(10, 2, 8) for _ in range(3))
    cu = torch.tensor([0, 7, 10], dtype=torch.int32)
    out = varlen_attention_through_sdpa(q, k, v, cu, cu, 10, 10)
    segment = torch.tensor([0] * 7 + [1] * 3)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(8)
    scores = scores.masked_fill(segment[:, None] != segment[None, :], float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    assert out.shape == (10, 2, 8) and torch.allclose(out, ref, atol=1e-5)
    whole = varlen_attention_through_sdpa(q, k, v, torch.tensor([0, 10]), torch.tensor([0, 10]))
    assert not torch.allclose(whole[:7], out[:7], atol=1e-3)   # the padding stretch is not attended


@pytest.mark.skipif(not DP_CHECKOUT.is_dir(), reason="no diffusion-pipe checkout")
def test_hunyuan_blocks_attention_runs_through_sdpa_where_flash_attn_is_missing():
    """HunyuanVideo's blocks call flash-attn's varlen kernel (None without flash-attn); after the bench's patch the
    same call attends within each stretch: [batch, tokens, heads x dim] out, equal to attention per stretch."""
    pytest.importorskip("diffusers")
    if importlib.util.find_spec("flash_attn"):
        pytest.skip("flash-attn is installed: diffusion-pipe's HunyuanVideo uses it")
    result = _run_hunyuan_check({"mode": "attention", "tokens": 12, "valid": 9})
    assert result["shape"] == [1, 12, 16] and result["err"] < 1e-5
