"""diffusion-pipe (tdrussell/diffusion-pipe) on the bench's cases, for bench/run.py's table: steady-state samples/s
(median step time after warm-up) and peak GPU memory of the same LoRA training run.py measures.

    python bench/diffusion_pipe.py --dp .carry/diffusion-pipe --cases flux-1024,sdxl-1024-b8 --out $OUT

diffusion-pipe is not part of this repository: ``--dp`` is a checkout of its source (with
``submodules/HunyuanVideo``, which it imports at start-up; ComfyUI comes from ``--comfyui`` / COMFYUI_PATH) and it
runs as its own process under the DeepSpeed launcher, ``train.py --deepspeed --config``. Its Python dependencies
(diffusers, datasets, toml, multiprocess, dill, deepspeed) must be importable; wandb and torchaudio, which it
imports but these cases never use, are stubbed when absent (``stubbed`` in the result). Python >= 3.12 (its
cache opens sqlite with ``autocommit=``) and CUDA (it moves the VAE to 'cuda' to cache latents).

Weights are random with the real configs, as in run.py (bench/diffusion_pipe_models.py writes them): Flux as a
diffusers FluxPipeline folder (flux-dev transformer and VAE; one-layer CLIP-L / T5 text encoders at the real output
widths, as diffusion-pipe caches their outputs before training), SDXL as a diffusers StableDiffusionXLPipeline folder
(SDXL base 1.0's UNet and VAE, both text encoders at full depth: diffusion-pipe trains their LoRA in every step),
Z-Image as ComfyUI-format files with a full-depth Qwen3-4B encoder, Qwen-Image as a diffusers folder (its 20B
transformer, VAE and whole Qwen2.5-VL-7B encoder: 57.7 GB of disk), Wan 2.1 as the official checkpoint folder with
ComfyUI-format transformer and full-depth UMT5-XXL encoder and a stand-in tokenizer (the model variant, e.g. 1.3B,
from the case; the 14B without one), HunyuanVideo as the ComfyUI-format files its README names (transformer, VAE,
full-depth LLaVA-Llama-3-8B and CLIP-L folders with ComfyUI's tokenizers). ``bench/run.py --diffusion-pipe`` runs both
trainers in one job on the same files where formats allow. Qwen-Image needs ``configs/qwen_image`` in the
diffusion-pipe checkout (its tokenizer, processor and configs); Wan needs easydict and ftfy, which its code
imports, and PyAV, through which it reads video (it refuses animated WebP). Captions are run.py's ``bench_caption``:
one 77-token CLIP chunk for SDXL, 252 Llama tokens for HunyuanVideo (its text length is 256), 505 T5 tokens elsewhere
(diffusers pads or cuts Flux's T5 text to 512). Eight images at the case's resolution, or for video cases eight MP4
clips of the case's frames at the model's frame rate (``frame_buckets`` of that length), LoRA rank 32 on
diffusion-pipe's targets, torch AdamW, bf16.

Three calls into diffusion-pipe are answered differently, and nothing else: SDXL's
``StableDiffusionXLPipeline.from_single_file(checkpoint_path, ...)`` needs component configs from the Hugging Face
Hub (nothing can be downloaded on the GPU machine), so for a folder this wrapper answers it with
``from_pretrained(folder, **the same kwargs)``: the pipeline it trains is the same diffusers classes with the same
configs. And diffusion-pipe 8f83dbf passes ``disable_dynamic=True`` to ComfyUI's ``comfy.sd.load_clip`` and
``load_diffusion_model``, a keyword newer than the ComfyUI 0.3.75 used here: the wrapper drops it where the
installed function's signature lacks it. Its Wan code calls flash-attn's varlen kernel and asserts flash-attn is
installed: where it is not, those calls go to the SDPA branch of its own Wan ``attention.py``
(``wan_attention_through_sdpa_without_flash_attn``). HunyuanVideo's blocks call flash-attn's varlen kernel too (None
without flash-attn): those calls go to the same attention per sequence stretch computed by SDPA
(``hunyuan_attention_through_sdpa_without_flash_attn``); its text-encoder loader reads ``CLIPTextModel.text_model``,
which transformers 5 removed, and finds the model itself there (``clip_text_model_as_its_own_text_model``). Its
code imports loguru (install it) and imageio.

Measures, per step: wall time of DeepSpeed's ``PipelineEngine.train_batch`` (CUDA-synchronised; this wrapper
patches the engine method in diffusion-pipe's process, diffusion-pipe's code is untouched) and
``torch.cuda.max_memory_allocated`` counted from the first step (run.py's measure), plus the peak of
``nvidia-smi``'s memory.used for the whole run (device level: CUDA context and allocator cache included), and
DeepSpeed's own "iter time" log lines as a cross-check. Writes ``diffusion_pipe.json`` keyed by run.py's case
names. ``--size tiny --write-only`` writes small models, datasets and configs (a CPU check of the writers;
diffusion-pipe itself needs CUDA); ``--frames`` shortens video cases' clips.
"""
from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import types
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from pipetrain.bench.run import Case

ENTRY_FLAG = "--dp-entry"   # the launcher runs this file with it: the wrapper around diffusion-pipe's train.py
STUBBED = ("wandb", "torchaudio", "av")
# submodules diffusion-pipe's imports name (av: ComfyUI's comfy_api video types, unused for image datasets)
STUB_SUBMODULES = {"av": ("container", "subtitles", "subtitles.stream")}


CASE_NAMES = ("flux-1024", "flux-1024-ckpt", "sdxl-1024-b8", "sdxl-1024-b4-ckpt", "zimage-1024-b4-ckpt",
              "qwen_image-1024-ckpt", "wan1.3b-480x832x81-ckpt", "wan14b-480x832x33-ckpt",
              "hunyuan_video-544x960x33-ckpt")


# --- dataset and diffusion-pipe's TOML configs --------------------------------------------------------
def write_dataset(folder: Path, count: int, side: int, caption: str) -> Path:
    from PIL import Image, ImageDraw

    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        img = Image.new("RGB", (side, side), (245, 245, 240))
        r, c = side // (4 + i % 3), side // 2
        ImageDraw.Draw(img).ellipse((c - r, c - r, c + r, c + r), fill=(200, 30 * i % 255, 40))
        img.save(folder / f"img{i:02d}.png")
        (folder / f"img{i:02d}.txt").write_text(caption)
    return folder


def write_video_dataset(folder: Path, count: int, frames: int, fps: float, side: int, caption: str) -> Path:
    """``count`` MP4 clips of run.py's moving disc, ``frames`` frames at ``fps`` (diffusion-pipe reads video through
    PyAV and refuses animated WebP, run.py's format)."""
    import av

    from pipetrain.bench.run import disc_clip_frames

    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        with av.open(str(folder / f"clip{i:02d}.mp4"), "w") as container:
            # MPEG-4 part 2: FFmpeg's own encoder, in every PyAV build
            stream = container.add_stream("mpeg4", rate=round(fps))
            stream.width = stream.height = side
            stream.pix_fmt = "yuv420p"
            for picture in disc_clip_frames(i, frames, side):
                container.mux(stream.encode(av.VideoFrame.from_image(picture)))
            container.mux(stream.encode())
        (folder / f"clip{i:02d}.txt").write_text(caption)
    return folder


def write_configs(run_dir: Path, case: Case, model: dict, steps: int, resolution: int, frames: int = 1) -> Path:
    """diffusion-pipe's main and dataset TOMLs; ``model``: the [model] section of the case's model files."""
    import tomli_w

    from pipetrain.bench.run import bench_caption

    count = 8
    # the baselines' text: one 77-token CLIP chunk for SDXL, 505 T5 tokens elsewhere (under Flux's 512)
    if frames > 1:
        from pipetrain.backend.models.registry import adapter_class

        dataset = write_video_dataset(run_dir / "dataset", count, frames, adapter_class(case.arch).framerate,
                                      resolution, bench_caption(case.arch))
    else:
        dataset = write_dataset(run_dir / "dataset", count, resolution, bench_caption(case.arch))
    # one epoch holds every step: an epoch boundary would add diffusion-pipe's end-of-epoch work to a timed step
    repeats = -(-(steps + 1) * case.batch // count)
    # [[directory]] as a table array, not tomli_w's inline table: diffusion-pipe passes this config to worker
    # processes without the JSON round trip it gives the main config for inline tables' sake
    (run_dir / "dataset.toml").write_text(
        f"resolutions = [{resolution}]\nenable_ar_bucket = false\nframe_buckets = [{frames}]\n\n"
        f"[[directory]]\npath = {json.dumps(str(dataset))}\nnum_repeats = {repeats}\n")
    main = {"output_dir": str(run_dir / "output"), "dataset": str(run_dir / "dataset.toml"), "epochs": 1000,
            "max_steps": steps, "micro_batch_size_per_gpu": case.batch, "pipeline_stages": 1,
            "gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "warmup_steps": 0,
            "save_every_n_epochs": 1000, "activation_checkpointing": case.checkpointing,
            "eval_before_first_step": False, "steps_per_print": 1, "caching_batch_size": 1, "map_num_proc": 1,
            "model": model,
            "adapter": {"type": "lora", "rank": 32, "dtype": "bfloat16"},
            "optimizer": {"type": "adamw", "lr": 1e-4, "betas": [0.9, 0.99], "weight_decay": 0.01, "eps": 1e-8}}
    (run_dir / "main.toml").write_text(tomli_w.dumps(main))
    return run_dir / "main.toml"


def write_case(name: str, case: Case, root: Path, comfyui: Path, size: str, steps: int,
               resolution: int | None, frames: int | None = None) -> dict:
    """The case's model files (shared by the cases of one arch, size and variant), dataset and configs."""
    import torch

    from pipetrain.bench.diffusion_pipe_models import model_folder, write_model_folder

    folder = model_folder(case.arch, root, size, case.variant)
    model = write_model_folder(case.arch, folder, size, comfyui, "cuda" if torch.cuda.is_available() else "cpu",
                               case.variant)
    config = write_configs(root / name, case, model, steps, resolution or case.resolution, frames or case.frames)
    return {"case": asdict(case), "config": str(config), "model_folder": str(folder)}


# --- running it ---------------------------------------------------------------------------------------
def dp_command(dp: Path, config: Path, events: Path, comfyui: Path, port: int) -> list[str]:
    return [sys.executable, "-u", "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", str(port),
            str(Path(__file__).resolve()), ENTRY_FLAG, str(dp), str(events), str(comfyui),
            "--deepspeed", "--config", str(config), "--master_port", str(port)]


class SmiPeak(threading.Thread):
    """Peak of nvidia-smi's memory.used on GPU 0 (MiB) while the run lasts."""

    def __init__(self, interval: float = 0.5):
        super().__init__(daemon=True)
        self.interval, self.peak_mib, self.stop = interval, None, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                      "-i", "0"], capture_output=True, text=True, timeout=10).stdout
                self.peak_mib = max(self.peak_mib or 0, int(out.split()[0]))
            except (OSError, ValueError, IndexError, subprocess.SubprocessError):
                return


ITER_TIME = re.compile(r"steps: (\d+) loss: \S+ .*iter time \(s\): ([0-9.]+)")


def summarise(case: Case, events: list[dict], log: str, warmup: int) -> dict:
    steps = [e for e in events if e.get("type") == "step"][warmup:]
    if not steps:
        return {}
    step_s = statistics.median(e["step_s"] for e in steps)
    ds_times = [float(t) for n, t in ITER_TIME.findall(log) if int(n) > warmup]
    start = next((e for e in events if e.get("type") == "start"), {})
    # a step is a whole optimizer step: micro-batch x gradient accumulation samples
    return {"samples_per_s": case.batch * case.gradient_accumulation / step_s, "step_s": step_s,
            "peak_gib": max(e["peak_alloc_gib"] for e in steps),
            "peak_reserved_gib": max(e["peak_reserved_gib"] for e in steps),
            "peak_before_training_gib": start.get("peak_alloc_gib"), "steps_measured": len(steps),
            "deepspeed_iter_s": statistics.median(ds_times) if ds_times else None, "stubbed": start.get("stubbed"),
            "cudnn_sdp": start.get("cudnn_sdp")}


def write_in_child(name: str, root: Path, comfyui: Path, size: str, steps: int, resolution: int | None,
                   frames: int | None) -> subprocess.CompletedProcess:
    """``--write-only`` for one case in a child process (model files skipped where complete): a CUDA context held
    by the caller would count in nvidia-smi's figure and take memory from the runs."""
    write = [sys.executable, str(Path(__file__).resolve()), "--write-only", "--cases", name, "--size", size,
             "--work", str(root), "--comfyui", str(comfyui), "--steps", str(steps), "--out", str(root / name)]
    for flag, value in (("--resolution", resolution), ("--frames", frames)):
        write += [flag, str(value)] if value else []
    return subprocess.run(write, capture_output=True, text=True)


def run_case(name: str, case: Case, dp: Path, root: Path, comfyui: Path, size: str, steps: int, warmup: int,
             resolution: int | None, timeout_s: float | None = None, frames: int | None = None,
             env: dict | None = None, adjust: Callable[[Path], dict] | None = None) -> dict:
    """``adjust(run_dir)``: rewrites the written configs before the run starts (bench/capped.py: diffusion-pipe's
    own example configs) and returns what it set, kept as ``settings``; ``env``: added to the run's environment."""
    run_dir = root / name
    shutil.rmtree(run_dir, ignore_errors=True)   # a fresh cache and output each time
    written = write_in_child(name, root, comfyui, size, steps, resolution, frames)
    if written.returncode != 0:
        return {"rc": written.returncode, "stage": "write", "stderr": written.stderr[-3000:]}
    from pipetrain.backend.process.command_lines import free_port
    from pipetrain.bench.diffusion_pipe_models import model_folder

    folder, config = model_folder(case.arch, root, size, case.variant), run_dir / "main.toml"
    events_file, log_file = run_dir / "events.jsonl", run_dir / "train.log"

    settings = adjust(run_dir) if adjust else None
    cmd = dp_command(dp, config, events_file, comfyui, free_port())
    smi = SmiPeak()
    smi.start()
    t = time.monotonic()
    with open(log_file, "w") as f:
        # its own session: a failed caching worker leaves diffusion-pipe waiting forever, so a timeout must end
        # the launcher and every process under it
        proc = subprocess.Popen(cmd, cwd=dp, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
    smi.stop.set()
    events = [json.loads(x) for x in events_file.read_text().splitlines()] if events_file.exists() else []
    result = {"rc": rc, "wall_s": round(time.monotonic() - t, 1), "log": str(log_file), "command": cmd,
              "smi_peak_gib": smi.peak_mib / 1024 if smi.peak_mib else None,
              "write_s": json.loads((folder / "written.json").read_text()).get("write_s"),
              **({"settings": settings} if settings is not None else {})}
    result.update(summarise(case, events, log_file.read_text(errors="replace"), warmup))
    if "samples_per_s" not in result:
        result["log_tail"] = log_file.read_text(errors="replace")[-3000:]
    return result


# --- inside diffusion-pipe's process -------------------------------------------------------------------
class _StubModule(types.ModuleType):
    """A module that is not installed: any name imported from it is an empty class (only named in annotations
    and isinstance checks on paths these cases never take)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        stand_in = type(name, (), {})
        setattr(self, name, stand_in)
        return stand_in


def load_sdxl_folders_with_from_pretrained() -> None:
    """diffusion-pipe's SDXL loads ``checkpoint_path`` with ``from_single_file``, which fetches the components'
    configs from the Hub; a diffusers folder (ours) goes to ``from_pretrained`` with the same arguments instead."""
    import diffusers

    pipeline = diffusers.StableDiffusionXLPipeline
    from_single_file = pipeline.from_single_file

    def load(cls: type, path: str | os.PathLike, **kwargs: object) -> object:
        if Path(path).is_dir():
            return cls.from_pretrained(path, **kwargs)
        return from_single_file(path, **kwargs)

    pipeline.from_single_file = classmethod(load)


def drop_keyword_where_unknown(module: types.ModuleType, name: str, keyword: str) -> None:
    """``module.name`` accepts ``keyword`` and drops it when the installed function has no such parameter."""
    function = getattr(module, name)
    if keyword in inspect.signature(function).parameters:
        return

    @functools.wraps(function)
    def without_keyword(*args: object, **kwargs: object) -> object:
        kwargs.pop(keyword, None)
        return function(*args, **kwargs)

    setattr(module, name, without_keyword)


def wan_attention_through_sdpa_without_flash_attn() -> None:
    """diffusion-pipe's Wan calls flash-attn's varlen kernel and asserts that flash-attn is installed. Where it is
    not (no wheel matches the GPU machine's torch), its calls go to the SDPA branch of the same file's
    ``attention``. That branch ignores key lengths: a step's one clip has no padding, the text keys' padding is
    attended (512 instead of the caption's tokens, in cross-attention only)."""
    import importlib.util
    import warnings

    if importlib.util.find_spec("flash_attn") or importlib.util.find_spec("flash_attn_interface"):
        return
    from models.wan import attention     # before models.wan.model and .clip bind flash_attention

    warnings.filterwarnings("ignore", message="Padding mask is disabled")

    def sdpa(q, k, v, q_lens=None, k_lens=None, dropout_p=0.0, softmax_scale=None, q_scale=None, causal=False,
             window_size=(-1, -1), deterministic=False, dtype=None, version=None):
        kw = {"dtype": dtype} if dtype is not None else {}
        return attention.attention(q, k, v, dropout_p=dropout_p, causal=causal, **kw).type(q.dtype)

    attention.flash_attention = sdpa


def bind_diffusion_pipe(dp: Path, comfyui: Path, stubs: tuple[str, ...] = STUBBED) -> list[str]:
    """diffusion-pipe's packages importable before ComfyUI's, and the modules of ``stubs`` that are not installed
    stubbed (returned). diffusion-pipe's utils/models are namespace packages and ComfyUI's utils a regular one, which
    would win: diffusion-pipe's are bound first (its own code puts its ComfyUI submodule on the path only after
    that, too)."""
    import importlib.machinery
    import importlib.util

    if str(dp) not in sys.path:
        sys.path.insert(0, str(dp))
    import models, optimizers, utils  # noqa: F401
    sys.path.insert(1, str(comfyui))
    stubbed = [m for m in stubs if importlib.util.find_spec(m) is None]
    for top in stubbed:
        for m in (top, *(f"{top}.{sub}" for sub in STUB_SUBMODULES.get(top, ()))):
            sys.modules[m] = _StubModule(m)
            # a spec but no distribution metadata: transformers' availability checks still say "not installed"
            sys.modules[m].__spec__ = importlib.machinery.ModuleSpec(m, None)
    return stubbed


def varlen_attention_through_sdpa(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q=None, max_seqlen_kv=None,
                                  *args, **kwargs):
    """flash-attn's ``flash_attn_varlen_func`` by SDPA: q, k, v are [total tokens, heads, dim] and each stretch
    between consecutive ``cu_seqlens`` attends to itself only (HunyuanVideo's blocks give a sample's image and real
    text tokens one stretch, its text padding the next). Returns [total tokens, heads, dim]."""
    import torch
    import torch.nn.functional as F

    out = []
    bounds_q, bounds_kv = cu_seqlens_q.tolist(), cu_seqlens_kv.tolist()
    for (q0, q1), (k0, k1) in zip(zip(bounds_q, bounds_q[1:]), zip(bounds_kv, bounds_kv[1:])):
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q[q0:q1], k[k0:k1], v[k0:k1]))
        out.append(F.scaled_dot_product_attention(qs, ks, vs)[0].transpose(0, 1))
    return torch.cat(out)


def hunyuan_attention_through_sdpa_without_flash_attn() -> None:
    """HunyuanVideo's blocks (its ``hyvideo.modules.attenion``) call flash-attn's varlen kernel, None where flash-attn
    is not installed (no wheel matches the GPU machine's torch): the calls go to ``varlen_attention_through_sdpa``,
    the same attention per stretch, computed by SDPA. Imports diffusion-pipe's HunyuanVideo model (which puts its
    submodule on the path)."""
    import importlib.util

    if importlib.util.find_spec("flash_attn"):
        return
    import models.hunyuan_video  # noqa: F401
    from hyvideo.modules import attenion

    attenion.flash_attn_varlen_func = varlen_attention_through_sdpa


def clip_text_model_as_its_own_text_model() -> None:
    """HunyuanVideo's text-encoder loader takes CLIP-L's final norm from ``CLIPTextModel.text_model``, which
    transformers 5 removed (the model holds the text model's modules itself): where it is missing, the model answers
    ``text_model`` with itself, so the loader finds the same norm."""
    import transformers

    if not hasattr(transformers.CLIPTextModel, "text_model") and "text_model" not in getattr(
            transformers.CLIPTextModel, "__annotations__", {}):
        transformers.CLIPTextModel.text_model = property(lambda self: self)


def optimizer_config_with_percentile_clipping() -> None:
    """diffusion-pipe's AdamW8bitKahan reads ``percentile_clipping`` and ``block_wise`` from bitsandbytes'
    per-parameter optimizer config, keys bitsandbytes 0.50 (the only wheel with a CUDA 13 build) no longer writes.
    Where they are missing, the config carries what older bitsandbytes wrote for this optimizer: 100 (clipping off)
    and block-wise states."""
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        return
    from bitsandbytes.optim.optimizer import Optimizer8bit

    get_config = Optimizer8bit.get_config

    @functools.wraps(get_config)
    def with_percentile_clipping(self, gindex, pindex, group):
        config = get_config(self, gindex, pindex, group)
        config.setdefault("percentile_clipping", getattr(self.args, "percentile_clipping", 100))
        config.setdefault("block_wise", True)    # 0.50 keeps 8-bit states by block only
        return config

    Optimizer8bit.get_config = with_percentile_clipping


def model_type(train_argv: list[str]) -> str | None:
    """The [model] type of the main config that train.py's arguments name (``--config PATH``)."""
    import tomllib

    config = train_argv[train_argv.index("--config") + 1]
    return tomllib.loads(Path(config).read_text())["model"].get("type")


def entry(argv: list[str]) -> None:
    """Run diffusion-pipe's train.py as __main__ with a timing and memory probe on DeepSpeed's train_batch.

    argv: DP EVENTS COMFYUI, then train.py's own arguments (the launcher puts --local_rank=N first)."""
    import runpy

    local_rank = [a for a in argv if a.startswith("--local_rank")]
    rest = [a for a in argv if not a.startswith("--local_rank")]
    dp, events_path, comfyui = (Path(p) for p in rest[1:4])
    # this file's folder (bench/, which has a models.py) must not shadow diffusion-pipe's models package
    sys.path[0] = str(dp)
    stubbed = bind_diffusion_pipe(dp, comfyui)
    wan_attention_through_sdpa_without_flash_attn()
    optimizer_config_with_percentile_clipping()
    if model_type(rest[4:]) == "hunyuan-video":
        hunyuan_attention_through_sdpa_without_flash_attn()
        clip_text_model_as_its_own_text_model()
    sys.argv = [str(dp / "train.py"), *local_rank, *rest[4:]]

    import comfy.sd
    import torch
    from deepspeed.runtime.pipe.engine import PipelineEngine

    # diffusion-pipe 8f83dbf passes disable_dynamic=True, a keyword newer than ComfyUI 0.3.75
    for loader in ("load_clip", "load_diffusion_model"):
        drop_keyword_where_unknown(comfy.sd, loader, "disable_dynamic")
    load_sdxl_folders_with_from_pretrained()

    # cuDNN's attention backward fails on the strides diffusers' Flux attention hands SDPA (torch 2.11, H200:
    # "mha_graph.execute(...) is_good()" under CUDA_LAUNCH_BLOCKING, CUBLAS_STATUS_EXECUTION_FAILED without);
    # SDPA then picks FlashAttention-2
    torch.backends.cuda.enable_cudnn_sdp(False)
    events = open(events_path, "a", buffering=1)
    original, state = PipelineEngine.train_batch, {"step": 0}

    def train_batch(self, *args, **kwargs):
        if state["step"] == 0:
            events.write(json.dumps({"type": "start", "stubbed": stubbed, "cudnn_sdp": False,
                                     "peak_alloc_gib": torch.cuda.max_memory_allocated() / 2 ** 30}) + "\n")
            torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = original(self, *args, **kwargs)
        torch.cuda.synchronize()
        state["step"] += 1
        events.write(json.dumps({"type": "step", "step": state["step"], "step_s": time.perf_counter() - t,
                                 "peak_alloc_gib": torch.cuda.max_memory_allocated() / 2 ** 30,
                                 "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2 ** 30}) + "\n")
        return out

    PipelineEngine.train_batch = train_batch
    os.chdir(dp)
    runpy.run_path(str(dp / "train.py"), run_name="__main__")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dp", default=".carry/diffusion-pipe", help="diffusion-pipe source checkout")
    p.add_argument("--cases", default="flux-1024,flux-1024-ckpt")
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--work", default="/tmp/diffusion-pipe-bench")
    p.add_argument("--comfyui", default=os.environ.get("COMFYUI_PATH"), help="ComfyUI folder (tokenizers, comfy)")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--size", default="full", help="full (figures) or tiny (a check of the writer)")
    p.add_argument("--resolution", type=int, help="override the cases' resolution (smoke tests)")
    p.add_argument("--frames", type=int, help="override video cases' clip length (smoke tests)")
    p.add_argument("--timeout-s", type=float, help="end a case's training run after this many seconds")
    p.add_argument("--write-only", action="store_true", help="write the models, dataset and configs; do not train")
    args = p.parse_args()
    if args.comfyui is None:
        from pipetrain.backend.host.runtime import ensure_comfyui
        args.comfyui = ensure_comfyui()
    dp, root, out, comfyui = Path(args.dp).resolve(), Path(args.work), Path(args.out), Path(args.comfyui).resolve()
    root.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    from pipetrain.bench.run import CASES

    results = {}
    for name in args.cases.split(","):
        if name not in CASE_NAMES:
            p.error(f"--cases: {name!r} is not one diffusion-pipe runs here; choose from {', '.join(CASE_NAMES)}")
        case = CASES[name]
        frames = args.frames if args.frames and case.frames > 1 else None
        if args.write_only:
            results[name] = write_case(name, case, root, comfyui, args.size, args.steps, args.resolution, frames)
        else:
            results[name] = {"case": asdict(case), "diffusion_pipe": run_case(
                name, case, dp, root, comfyui, args.size, args.steps, args.warmup, args.resolution, args.timeout_s,
                frames)}
        (out / "diffusion_pipe.json").write_text(json.dumps(results, indent=1))
        r = results[name].get("diffusion_pipe", results[name])
        shown = ("rc", "samples_per_s", "step_s", "peak_gib", "smi_peak_gib", "deepspeed_iter_s", "config")
        print(json.dumps({"case": name, **{k: r[k] for k in shown if k in r}}))
    return 0


if __name__ == "__main__":
    if ENTRY_FLAG in sys.argv:
        entry(sys.argv[1:])
    else:
        raise SystemExit(main())
