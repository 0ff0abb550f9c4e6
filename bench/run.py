"""PipeTrain's GPU benchmark: steady-state samples/s, peak memory and MFU of real-size LoRA training,
measured in the same job as the baselines (the bare eager loop and ComfyUI's native trainer, whose
scripts live outside this repository: pass their paths).

    python bench/run.py --cases flux-1024,flux-1024-ckpt --out $OUT \
        [--bare /path/to/bare_ceiling.py] [--native /path/to/native_trainer.py] [--comfyui PATH]

Weights are random with the real architecture configs (step time does not depend on their values);
text encoders are shallow (a few layers at the real width: their cost is in caching, not in the step). Video cases
train on generated animated-WebP clips of ``frames`` frames at the model's frame rate, square at the case's
resolution (640^2 stands for 480x832: the same area, the same token count; 720^2 for 544x960). Prints a table and
writes ``bench.json``. Needs a CUDA GPU with PipeTrain's dependencies installed; ``--size tiny --resolution 64
--frames 9`` runs every case's code path on the CPU with tiny models (a smoke test, no figures).

``--diffusion-pipe CHECKOUT`` also trains the cases bench/diffusion_pipe.py runs with diffusion-pipe, after ours in the
same job (``diffusion_pipe`` in the results, its columns in the table). Its model files are written first and, where
they are in ComfyUI's formats (Wan's, HunyuanVideo's), ours trains on them: one set of files a case. Before a case's
files are written, other models' full-size files under ``--work`` are removed (``free_disk_for``: Wan 14B and
HunyuanVideo take about 40 GB each of the GPU machine's 64 GiB disk), so a later case of a removed model writes its
files again.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

PEAK_TFLOPS = 790.0   # bf16 matrix product measured on this H200 (KINDS.md)
BENCH_PHRASE = "a red circle on a white background"
PROFILED_STEPS = 2    # with --profile: recorded after warm-up and left out of the timing


def bench_caption(arch: str) -> str:
    """As long as the baselines' text: SDXL's one 77-token CLIP chunk, HunyuanVideo's 256 Llama tokens (252:
    diffusion-pipe's text length), 505 T5 tokens (their 512) elsewhere."""
    return " ".join([BENCH_PHRASE] * {"sdxl": 10, "hunyuan_video": 36}.get(arch, 56))


@dataclass(frozen=True)
class Case:
    arch: str
    resolution: int
    batch: int
    checkpointing: bool | str = False  # activation_checkpointing: false, true or a named mode ('selective')
    compile: bool = False
    stages: int = 1
    gradient_accumulation: int = 1
    bare_case: str | None = None      # the bare loop's CASES name for the same model
    native_case: str | None = None    # native_trainer.py's CASE name
    frames: int = 1                   # video models: clip length
    variant: str | None = None        # a published size other than the adapter's full one (VARIANTS)
    checkpoint_fraction: float = 1.0  # with checkpointing: the share of blocks checkpointed
    lora_dtype: str | None = None     # [adapter] dtype; None: PipeTrain's default (float32 weights and AdamW states)
    memory_budget: float | None = None  # with compile: activation_memory_budget
    fp8_compute: bool = False         # frozen base linears multiply in FP8 (bench/fp8_gate.py: its quality gate)
    data_parallel: int = 1            # ranks per stage: the run takes stages x data_parallel GPUs
    full_finetune: bool = False       # no [adapter] table: every diffusion-model weight trains
    optimizer: str = "adamw"


def _wan_1_3b() -> dict:
    from pipetrain.backend.models.wan import wan_config
    return wan_config(1536, 8960, 30)


VARIANTS = {"wan-1.3b": _wan_1_3b}    # name -> the diffusion model's unet_config

CASES = {
    "flux-1024": Case("flux", 1024, 1, bare_case="flux", native_case="flux"),
    "flux-1024-compile-fp8": Case("flux", 1024, 1, compile=True, fp8_compute=True, bare_case="flux"),
    # FP8 weights in place of the bf16 ones (11 GiB less for Flux-dev) with the checkpointing modes
    "flux-1024-selective-compile-fp8": Case("flux", 1024, 1, checkpointing="selective", compile=True,
                                           fp8_compute=True),
    "flux-1024-ckpt-compile-fp8": Case("flux", 1024, 1, checkpointing=True, compile=True, fp8_compute=True),
    "flux-1024-ckpt": Case("flux", 1024, 1, checkpointing=True, native_case="flux"),
    "flux-1024-compile": Case("flux", 1024, 1, compile=True, bare_case="flux", native_case="flux"),
    "flux-1024-ckpt-compile": Case("flux", 1024, 1, checkpointing=True, compile=True, native_case="flux"),
    "flux-1024-selective-compile": Case("flux", 1024, 1, checkpointing="selective", compile=True,
                                       native_case="flux"),
    # the adapter dtype bench/diffusion_pipe.py gives diffusion-pipe: LoRA weights and AdamW states in bfloat16
    "flux-1024-ckpt-compile-bf16lora": Case("flux", 1024, 1, checkpointing=True, compile=True, lora_dtype="bfloat16"),
    "flux-1024-budget50-compile": Case("flux", 1024, 1, compile=True, memory_budget=0.5, native_case="flux"),
    "flux-1024-budget25-compile": Case("flux", 1024, 1, compile=True, memory_budget=0.25, native_case="flux"),
    "flux-1024-ckpt-half-compile": Case("flux", 1024, 1, checkpointing=True, compile=True, checkpoint_fraction=0.5,
                                        native_case="flux"),
    "flux-1024-ckpt-third-compile": Case("flux", 1024, 1, checkpointing=True, compile=True,
                                         checkpoint_fraction=1 / 3, native_case="flux"),
    "sdxl-1024-b8": Case("sdxl", 1024, 8, bare_case="sdxl", native_case="sdxl"),
    "sdxl-1024-b8-compile": Case("sdxl", 1024, 8, compile=True, bare_case="sdxl", native_case="sdxl"),
    # TrainLoraNode's SDXL batch (4), checkpointed as its only run that fits: the comparison at equal memory
    "sdxl-1024-b4-ckpt": Case("sdxl", 1024, 4, checkpointing=True, native_case="sdxl"),
    "sdxl-1024-b4-ckpt-compile": Case("sdxl", 1024, 4, checkpointing=True, compile=True, native_case="sdxl"),
    "sdxl-1024-b4-selective": Case("sdxl", 1024, 4, checkpointing="selective", native_case="sdxl"),
    # TrainLoraNode's memory (22.8 GiB checkpointed at batch 4) holds batch 8 here: checkpointed SDXL is bound by
    # the host's kernel launches at batch 4, so twice the batch costs little more time
    "sdxl-1024-b8-ckpt": Case("sdxl", 1024, 8, checkpointing=True, native_case="sdxl"),
    "sdxl-1024-b8-selective": Case("sdxl", 1024, 8, checkpointing="selective", native_case="sdxl"),
    "flux-1024-2stages-ga8": Case("flux", 1024, 1, stages=2, gradient_accumulation=8),
    "flux-1024-1stage-ga8": Case("flux", 1024, 1, gradient_accumulation=8),
    "zimage-1024-b4": Case("z_image", 1024, 4),
    "zimage-1024-b4-ckpt": Case("z_image", 1024, 4, checkpointing=True),
    # diffusion-pipe's adapter dtype: Z-Image's 87 M LoRA parameters then take 8 bytes less each (0.65 GiB), the
    # gap between zimage-1024-b4-ckpt's peak and diffusion-pipe's
    "zimage-1024-b4-ckpt-bf16lora": Case("z_image", 1024, 4, checkpointing=True, lora_dtype="bfloat16"),
    "zimage-1024-b4-unsloth-bf16lora": Case("z_image", 1024, 4, checkpointing="unsloth", lora_dtype="bfloat16"),
    "qwen_image-1024": Case("qwen_image", 1024, 1),
    "qwen_image-1024-ckpt": Case("qwen_image", 1024, 1, checkpointing=True),
    # beside diffusion-pipe's peak, which qwen_image-1024-ckpt's exceeds by 3% (1.35 GiB)
    "qwen_image-1024-ckpt-bf16lora": Case("qwen_image", 1024, 1, checkpointing=True, lora_dtype="bfloat16"),
    "qwen_image-1024-unsloth-bf16lora": Case("qwen_image", 1024, 1, checkpointing="unsloth", lora_dtype="bfloat16"),
    "wan1.3b-480x832x81": Case("wan", 640, 1, frames=81, variant="wan-1.3b"),
    "wan1.3b-480x832x81-ckpt": Case("wan", 640, 1, checkpointing=True, frames=81, variant="wan-1.3b"),
    # the Flux settings that measured best, on the other models (Z-Image: no faster than `true`, 4 GiB more)
    "zimage-1024-b4-selective-compile": Case("z_image", 1024, 4, checkpointing="selective", compile=True),
    "qwen_image-1024-selective-compile": Case("qwen_image", 1024, 1, checkpointing="selective", compile=True),
    "wan1.3b-480x832x81-selective-compile": Case("wan", 640, 1, checkpointing="selective", compile=True, frames=81,
                                                 variant="wan-1.3b"),
    # issue #27's video models beside diffusion-pipe: Wan 2.1 T2V 14B and HunyuanVideo T2V 13B (720^2 stands for
    # 544x960: the same area within 1%, 2025 tokens a latent frame against 2040)
    "wan14b-480x832x33-ckpt": Case("wan", 640, 1, checkpointing=True, frames=33),
    "wan14b-480x832x33-ckpt-compile": Case("wan", 640, 1, checkpointing=True, compile=True, frames=33),
    "hunyuan_video-544x960x33-ckpt": Case("hunyuan_video", 720, 1, checkpointing=True, frames=33),
}


def models_name(case: Case, size: str) -> str:
    """The folder (and ``.json`` marker) under the work root that ``write_models`` writes the case's files to."""
    return f"{case.arch}-{size}" + (f"-{case.variant}" if case.variant and size == "full" else "")


def free_disk_for(root: Path, keep: str | tuple[str, ...]) -> list[str]:
    """Remove the full-size model files under ``root`` (``write_models``' and diffusion-pipe's folders, their
    markers) whose names do not start with ``keep``: a case's full-size files outgrow the GPU machine's disk beside
    another's (Wan 14B and HunyuanVideo, 40 GB each, on 64 GiB; Flux-dev, Flux 2 and Wan 14B on a 2-GPU machine's
    128 GiB). Returns what went."""
    import re
    import shutil

    gone = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        if re.fullmatch(r"[a-z0-9_.]+(-dp)?-full(-[a-z0-9.-]+)?(\.json)?", path.name) and not path.name.startswith(keep):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            gone.append(path.name)
    return gone


def written_models(case: Case, root: Path, size: str = "full") -> dict | None:
    """The files ``write_models`` wrote for the case (or a test shared, ``tests/conftest.share_model_files``), None
    where there are none yet: read from its marker, nothing imported."""
    marker = root / f"{models_name(case, size)}.json"
    return json.loads(marker.read_text()) if marker.exists() else None


def write_models(case: Case, root: Path, size: str = "full"):
    written = written_models(case, root, size)
    if written is not None:
        return written
    from pipetrain.backend.models.tiny import write_model_files

    name = models_name(case, size)
    marker = root / f"{name}.json"
    t = time.monotonic()
    import torch
    unet_config = VARIANTS[case.variant]() if case.variant and size == "full" else None
    files = write_model_files(case.arch, root / name, size, torch.bfloat16,
                              text_encoder_size="shallow" if size == "full" else size,
                              init_device="cuda" if torch.cuda.is_available() else "cpu", unet_config=unet_config)
    data = {"diffusion_model": str(files.diffusion_model), "vae": str(files.vae),
            "text_encoders": [str(p) for p in files.text_encoders], "write_s": round(time.monotonic() - t, 1)}
    marker.write_text(json.dumps(data))
    return data


def disc_clip_frames(index: int, frames: int, side: int) -> list:
    """The pictures of clip ``index``: a disc crossing a ``side``-square picture in ``frames`` frames."""
    from PIL import Image, ImageDraw

    pictures = []
    for f in range(frames):
        picture = Image.new("RGB", (side, side), (240, 240, 235))
        x = int((f / max(frames - 1, 1)) * side * 0.8) + side // 10
        ImageDraw.Draw(picture).ellipse((x - side // 10, side // 3, x + side // 10, side // 3 + side // 5),
                                        fill=(200, 40 + 20 * index, 40))
        pictures.append(picture)
    return pictures


def write_clips(folder: Path, count: int, frames: int, fps: float, side: int) -> None:
    """``count`` animated WebP clips of a disc crossing the picture, ``frames`` frames at ``fps``."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        pictures = disc_clip_frames(i, frames, side)
        # a little longer per frame than 1/fps, so the clip surely fills ``frames`` frames at the model's rate
        pictures[0].save(folder / f"clip{i:02d}.webp", save_all=True, append_images=pictures[1:],
                         duration=int(1000 / fps) + 1, lossless=False, quality=60)
        (folder / f"clip{i:02d}.txt").write_text("a red ball rolling across a white floor")


def write_config(name: str, case: Case, files: dict, root: Path, steps: int, resolution: int | None = None,
                 frames: int | None = None) -> Path:
    import tomli_w
    from pipetrain.backend.commands.demo import make_dataset
    from pipetrain.backend.models.registry import adapter_class

    folder = root / name
    resolution, frames = resolution or case.resolution, frames or case.frames
    count = max(8, case.batch * case.gradient_accumulation * case.data_parallel)
    if frames > 1:
        write_clips(folder / "dataset", count, frames, adapter_class(case.arch).framerate, resolution)
    else:
        make_dataset(folder / "dataset", count)
    for caption in (folder / "dataset").glob("*.txt"):
        caption.write_text(bench_caption(case.arch))
    dataset = {"resolutions": [resolution], "enable_ar_bucket": False, "frame_buckets": [frames],
               "directory": [{"path": str(folder / "dataset"), "num_repeats": 4}]}
    run = {"output_dir": str(folder / "output"), "dataset": str(folder / "dataset.toml"), "epochs": 100,
           "max_steps": steps, "micro_batch_size_per_gpu": case.batch, "pipeline_stages": case.stages,
           "gradient_accumulation_steps": case.gradient_accumulation, "save_every_n_epochs": 1000,
           "activation_checkpointing": case.checkpointing, "compile": case.compile, "run_name": "bench",
           "activation_checkpointing_fraction": case.checkpoint_fraction,
           **({"activation_memory_budget": case.memory_budget} if case.memory_budget is not None else {}),
           **({"fp8_compute": True} if case.fp8_compute else {}),
           "model": {"type": case.arch, "diffusion_model": files["diffusion_model"], "vae": files["vae"],
                     "text_encoders": files["text_encoders"], "dtype": "bfloat16"},
           "optimizer": {"type": case.optimizer, "lr": 1e-4}}
    if not case.full_finetune:
        run["adapter"] = {"rank": 32, "alpha": 32.0, **({"dtype": case.lora_dtype} if case.lora_dtype else {})}
    (folder / "dataset.toml").write_text(tomli_w.dumps(dataset))
    (folder / "run.toml").write_text(tomli_w.dumps(run))
    return folder / "run.toml"


def run_ours(name: str, case: Case, files: dict, root: Path, steps: int, warmup: int, profile: Path | None = None,
             timeout_s: float | None = None, stop_after: str | None = None, env: dict | None = None,
             adjust=None, **overrides) -> dict:
    """The case through ``pipetrain train`` under DeepSpeed's launcher (``stages x data_parallel`` ranks); with
    ``profile``, the PROFILED_STEPS steps after warm-up are also recorded there with torch.profiler and as many
    after them sampled on the host (``PIPETRAIN_PROFILE``), all left out of the timing. ``peak_gib`` is rank 0's
    peak (the first stage's), ``peak_gib_per_rank`` every rank's (the ``memory`` event, GPUs only); ``stop_after``:
    see ``train_run``. ``adjust(config)`` rewrites the written run.toml before the run starts (bench/capped.py) and
    returns what it set, kept as ``settings``; ``env`` is added to the run's environment. ``memory_plan``: what
    ``memory = "auto"`` chose, where it planned."""
    config = write_config(name, case, files, root, steps, **overrides)
    settings = adjust(config) if adjust else None
    log = root / f"{name}.log"
    env = dict(env or {})
    if profile:   # the profiler's module imports torch, which an unprofiled case's process never needs
        from pipetrain.backend.train.profiling import ENV, recorded_steps

        env[ENV] = f"{profile}:{warmup + 1}:{PROFILED_STEPS}"
    rc, events = train_run(config, case.stages * case.data_parallel, log, env=env, timeout_s=timeout_s,
                           stop_after=stop_after)
    steps_ = [e for e in events if e["type"] == "step"][warmup:]
    profiled = [{k: e[k] for k in ("wall_ms_per_step", "kernel_busy_ms_per_step", "gpu_busy", "host_ms_per_step")
                 if k in e}
                for e in events if e["type"] == "profile"]
    if profile:   # the profiled steps run slower: they are not timed
        steps_ = steps_[recorded_steps(PROFILED_STEPS):]
    plan = next(({k: e.get(k) for k in ("chosen", "gpu_gib", "stages_gib", "reason")}
                 for e in events if e["type"] == "memory_plan"), None)
    extra = {**({"settings": settings} if settings is not None else {}), **({"memory_plan": plan} if plan else {})}
    if rc != 0 or not steps_:   # the tail comes back from the GPU machine where the log does not
        return {"rc": rc, "log": str(log), "log_tail": log.read_text(errors="replace")[-3000:], **extra}
    samples = case.batch * case.gradient_accumulation * case.data_parallel
    step_time = statistics.median(e["step_time_s"] for e in steps_)
    memory = next((e for e in events if e["type"] == "memory"), {})
    return {"rc": rc, "samples_per_s": samples / step_time, "step_s": step_time,
            "peak_gib": max(e.get("peak_mem_gib", 0) for e in steps_), "steps_measured": len(steps_),
            **({"peak_gib_per_rank": memory["peak_mem_gib_per_rank"]} if memory else {}),
            **({"profile": profiled[0]} if profiled else {}), **extra}


def train_run(config: Path, ranks: int, log: Path, env: dict | None = None, timeout_s: float | None = None,
              stop_after: str | None = None, run_name: str = "bench") -> tuple[int, list[dict]]:
    """``pipetrain train CONFIG`` on ``ranks`` ranks under DeepSpeed's launcher (or the warm ranks of
    ``bench/ranks.py``), its output in ``log``; returns the exit status and the events of the run ``run_name`` in the
    config's ``output`` folder. The launcher and its ranks are killed at ``timeout_s`` (status 124), or once an event
    of type ``stop_after`` is written (status 0: what was to be measured is in). They stay in the caller's process
    group, so whoever kills that group (the multi-GPU harness at a case's timeout) takes them too."""
    from pipetrain.backend.run.folder import RunDir
    from pipetrain.bench.ranks import start_ranks

    # a measurement's run is disposable, and a run_name that holds a run is refused: an earlier case's or job's
    # run of this name goes first
    shutil.rmtree(config.parent / "output" / run_name, ignore_errors=True)
    events_file = RunDir(config.parent / "output" / run_name).events_file

    def events() -> list[dict]:
        lines = events_file.read_text().splitlines() if events_file.exists() else []
        return [json.loads(x) for x in lines if x.strip()]

    deadline = time.monotonic() + timeout_s if timeout_s else math.inf
    run = start_ranks("train", config, ranks, ["--no-progress"], log, {**os.environ, **(env or {})})
    while (rc := run.poll()) is None:
        stop = bool(stop_after) and any(e["type"] == stop_after for e in events())
        if stop or time.monotonic() > deadline:
            run.kill()
            with open(log, "a") as f:
                f.write(f"\n[bench] stopped at the {stop_after} event\n" if stop else
                        f"\n[bench] killed after {timeout_s:.0f} s\n")
            rc = 0 if stop else 124
            break
        time.sleep(1.0)
    return rc, events()


# PyAV: ComfyUI's comfy_api imports it (and names two of its submodules) when TrainLoraNode's module loads
AV_STAND_IN = """def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (), {})
"""


def write_av_stand_in(folder: Path) -> Path:
    """A stand-in PyAV package under ``folder`` (to put on PYTHONPATH) for a machine without it: any name imported
    from it is an empty class. The native baseline trains on latents and never decodes video."""
    from pipetrain.bench.diffusion_pipe import STUB_SUBMODULES   # the submodules comfy_api names

    for module in ("av", *(f"av.{sub}" for sub in STUB_SUBMODULES["av"])):
        package = folder.joinpath(*module.split("."))
        package.mkdir(parents=True, exist_ok=True)
        (package / "__init__.py").write_text(AV_STAND_IN)
    return folder


def run_script(script: str, env: dict, pick=lambda record: True) -> dict:
    """Run a baseline script in its own process; its result is the JSON line ``pick`` accepts. Where PyAV is not
    installed, the script sees a stand-in (``stand_in_av`` in the result)."""
    env = {**os.environ, **env}
    stand_in = importlib.util.find_spec("av") is None
    with tempfile.TemporaryDirectory() as tmp:
        if stand_in:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(write_av_stand_in(Path(tmp))),
                                                              env.get("PYTHONPATH")]))
        out = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True)
    records = [{**json.loads(x), **({"stand_in_av": True} if stand_in else {})}
               for x in out.stdout.splitlines() if x.startswith("{")]
    chosen = [r for r in records if pick(r)]
    return chosen[-1] if chosen else {"rc": out.returncode, "stderr": out.stderr[-2000:], "records": records}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="flux-1024,flux-1024-ckpt")
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--work", default="/tmp/pipetrain-bench")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--baselines", default="all", help="'all', 'none', or e.g. 'bare' (skip native)")
    p.add_argument("--bare", help="path to bare_ceiling.py (the bare eager loop)")
    p.add_argument("--native", help="path to native_trainer.py (ComfyUI's TrainLoraNode)")
    p.add_argument("--comfyui", default=None, help="ComfyUI folder for the baselines (default: PipeTrain's)")
    p.add_argument("--size", default="full", help="model size: full (figures) or tiny (a CPU smoke test)")
    p.add_argument("--resolution", type=int, help="override every case's resolution (smoke tests)")
    p.add_argument("--frames", type=int, help="override video cases' clip length (smoke tests)")
    p.add_argument("--profile", action="store_true",
                   help="record two steps after warm-up with torch.profiler and sample two more on the host, into "
                        "<out>/<case>-profile/ (left out of the timing)")
    p.add_argument("--diffusion-pipe", metavar="CHECKOUT",
                   help="also train the cases bench/diffusion_pipe.py runs with diffusion-pipe (this checkout), after "
                        "ours in the same job; where its model files are in ComfyUI's formats, ours trains on them")
    p.add_argument("--timeout-s", type=float, help="end each training run after this many seconds")
    args = p.parse_args()
    from pipetrain.backend.host.runtime import locate_comfyui

    comfy_root = str(args.comfyui or locate_comfyui())   # its folder: the runs and baselines import it, not this
    root, out = Path(args.work), Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in args.cases.split(","):
        case = CASES[name]
        frames = args.frames if args.frames and case.frames > 1 else None
        with_dp = bool(args.diffusion_pipe) and dp_runs(name)
        try:
            files, freed = case_models(name, case, root, args, Path(comfy_root), with_dp)
        except RuntimeError as exc:   # the next case still runs
            results[name] = {"case": asdict(case), "ours": {"rc": 1, "stage": "write", "error": str(exc)}}
            (out / "bench.json").write_text(json.dumps(results, indent=1))
            continue
        r = {"case": asdict(case), **({"freed": freed} if freed else {}),
             "ours": run_ours(name, case, files, root / "pipetrain" if with_dp else root, args.steps, args.warmup,
                              profile=out / f"{name}-profile" if args.profile else None, timeout_s=args.timeout_s,
                              resolution=args.resolution, frames=frames)}
        if with_dp:
            from pipetrain.bench.diffusion_pipe import run_case
            results[name] = r   # ours is in even if the job ends during diffusion-pipe's run
            (out / "bench.json").write_text(json.dumps(results, indent=1))
            r["diffusion_pipe"] = run_case(name, case, Path(args.diffusion_pipe).resolve(), root, Path(comfy_root),
                                           args.size, args.steps, args.warmup, args.resolution, args.timeout_s, frames)
        if args.bare and case.bare_case and args.baselines in ("all", "bare"):
            r["bare"] = run_script(args.bare, {"COMFYUI_PATH": comfy_root, "CASES": case.bare_case})
        if args.native and case.native_case and args.baselines in ("all", "native"):
            r["native"] = run_script(args.native, {"COMFYUI_PATH": comfy_root, "CASE": case.native_case},
                                     pick=lambda rec, ckpt=bool(case.checkpointing): rec.get("gc") == ckpt)
        results[name] = r
        (out / "bench.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    for line in pipeline_efficiency(results):
        print(line)
    return 0


def dp_runs(name: str) -> bool:
    from pipetrain.bench.diffusion_pipe import CASE_NAMES
    return name in CASE_NAMES


def case_models(name: str, case: Case, root: Path, args, comfyui: Path, with_dp: bool) -> tuple[dict, list[str]]:
    """The model files ours trains the case on, and the full-size files of other models removed first to make room.
    With diffusion-pipe, its files are written first (in a child process, as it writes them for its own run) and
    ours trains on them where its writer shares them (``pipetrain_files``): one set of files on the disk."""
    from pipetrain.bench.diffusion_pipe_models import model_folder, pipetrain_files

    folder = model_folder(case.arch, root, args.size, case.variant)
    freed = free_disk_for(root, (models_name(case, args.size), folder.name))
    if not with_dp:
        return write_models(case, root, args.size), freed
    from pipetrain.bench.diffusion_pipe import write_in_child

    written = write_in_child(name, root, comfyui, args.size, args.steps, args.resolution, args.frames)
    if written.returncode != 0:
        raise RuntimeError(f"{name}: writing diffusion-pipe's model files failed:\n{written.stderr[-3000:]}")
    return pipetrain_files(folder) or write_models(case, root, args.size), freed


def table(results: dict) -> str:
    rows = [f"{'case':24s} {'ours s/s':>9s} {'peak GiB':>8s} {'bare s/s':>9s} {'ours/bare':>9s} {'native s/s':>10s} "
            f"{'ours/native':>11s} {'MFU':>5s} {'dp s/s':>7s} {'dp GiB':>7s} {'ours/dp':>7s}"]
    for name, r in results.items():
        ours, bare, native = r["ours"], r.get("bare") or {}, r.get("native") or {}
        dp = r.get("diffusion_pipe") or {}
        sps = ours.get("samples_per_s")
        b, n, d = bare.get("samples_s"), native.get("samples_s"), dp.get("samples_per_s")
        mfu = (bare["tflop_per_step"] / bare.get("bs", 1) * sps / PEAK_TFLOPS) if sps and bare.get("tflop_per_step") else None
        rows.append(f"{name:24s} {_f(sps):>9s} {_f(ours.get('peak_gib')):>8s} {_f(b):>9s} {_f(sps / b if sps and b else None):>9s} "
                    f"{_f(n):>10s} {_f(sps / n if sps and n else None):>11s} {_f(mfu):>5s} {_f(d):>7s} "
                    f"{_f(dp.get('peak_gib')):>7s} {_f(sps / d if sps and d else None):>7s}")
    return "\n".join(rows)


def pipeline_efficiency(results: dict) -> list[str]:
    """For each case run on p > 1 stages (one GPU each) beside the same case on one: the measured speed-up,
    the efficiency (speed-up / p) and its bound from the pipeline bubble, 1 - (p-1)/(m+p-1) with m micro-batches
    (gradient accumulation steps) per step."""
    lines = []
    for name, r in results.items():
        case, sps = r["case"], r["ours"].get("samples_per_s")
        p, m = case["stages"], case["gradient_accumulation"]
        single = next((o["ours"].get("samples_per_s") for o in results.values()
                       if o["case"] == {**case, "stages": 1}), None)
        if p > 1 and sps and single:
            speedup, bound = sps / single, m / (m + p - 1)
            lines.append(f"{name}: {p} stages vs 1, GA {m}: speed-up {speedup:.2f}x, efficiency {speedup / p:.0%} "
                         f"(bubble bound {bound:.0%})")
    return lines


def _f(x) -> str:
    return "-" if x is None else f"{x:.2f}"


if __name__ == "__main__":
    raise SystemExit(main())
