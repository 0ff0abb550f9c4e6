"""Every registered architecture at its published size, a few LoRA training steps each on one GPU: does it
fit, how fast, how much memory. The model is ComfyUI's own class built straight on the device with
random weights (no files: writing 20-32B random checkpoints would cost minutes each), wrapped in PipeTrain's
pipeline layers with LoRA rank 32 on the adapter's targets and AdamW; latents and text come from the adapter's
probes (short captions; clean latents at the given resolution, and ``--frames`` for video models).

    python bench/models.py --out $OUT [--archs qwen_image,z_image] [--resolution 1024] [--frames 33] [--batch 8]
        [--seconds 60]   (audio models: the clip's length)
        [--channels-last]
        [--checkpointing [--checkpoint-fraction 0.5]] [--compile [--compile-inside-checkpoint] [--memory-budget 0.5]]
        [--deadline-s 300] [--profile]

Writes ``models.json`` after every model, so a deadline cuts the list, never the results. ``--profile`` records
two steps after the timed ones with torch.profiler into ``<arch>-profile/`` (``trace.json``, ``ops.txt``
by GPU time, ``summary.json`` with the share of wall time the GPU ran kernels) and samples two more on the host
(``host.txt``, the Python code the wall time went to): where a step's time goes.
The trainer records the same on demand: ``PIPETRAIN_PROFILE`` (``backend/train/profiling.py``).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch


def build(arch: str, device: str, dtype: torch.dtype, size: str):
    from pipetrain.backend.config import ModelConfig
    from pipetrain.backend.models import loading, tiny
    from pipetrain.backend.models.registry import adapter_class, arch_spec

    patcher = loading.build_model(arch, arch_spec(arch).unet_config(size), dtype, device)
    dm = patcher.model.diffusion_model
    inits = {key: init for key, _, init in tiny.tensor_plan(dm)}
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for key, t in list(dm.state_dict(keep_vars=True).items()):
            init = inits.get(key)
            if not t.is_floating_point() or init is None:
                continue
            if init == "normal":
                t.normal_(0.0, tiny.INIT_STD, generator=g)
            else:
                t.fill_(1.0 if init == "ones" else 0.0)
    adapter = adapter_class(arch)(ModelConfig(type=arch, diffusion_model="unused", vae="unused",
                                              dtype="bfloat16" if dtype == torch.bfloat16 else "float32"))
    adapter.use_model(patcher)
    return adapter


def probe_inputs(adapter, resolution: int, frames: int, device: str, seconds: float = 60.0):
    from pipetrain.backend.models.meta_trace import probe_inputs as probe
    if getattr(adapter, "audio", False):   # ACE-Step: a clip of ``seconds`` (latent width: its latent frames x 8)
        from pipetrain.backend.models.ace_step import LATENT_HOP, SAMPLE_RATE
        return probe(adapter, round(seconds * SAMPLE_RATE / LATENT_HOP) * 8, 128, device=device)
    return probe(adapter, resolution, resolution, frames, device=device)


def batched(inputs: tuple, batch: int, channels_last: bool) -> tuple:
    """The probe repeated to ``batch`` samples; with ``channels_last`` the 4-D latents (x0, noise) are stored
    NHWC, so the convolutions that read them run channels-last from the first layer on."""
    out = tuple(x.repeat(batch, *(1,) * (x.ndim - 1)) for x in inputs)
    if channels_last:
        out = tuple(x.contiguous(memory_format=torch.channels_last) if i < 2 and x.ndim == 4 else x
                    for i, x in enumerate(out))
    return out


def _step(layers, inputs, adapter, opt) -> torch.Tensor:
    h = inputs
    for layer in layers:
        h = layer(h)
    loss = adapter.loss(h, inputs[:3])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def profile_steps(arch: str, step, out: Path, steps: int = 2) -> dict:
    """``steps`` steps under torch.profiler, then ``steps`` more sampled on the host, as the trainer's
    ``PIPETRAIN_PROFILE`` records them, into ``out/<arch>-profile/``; returns the summary."""
    from pipetrain.backend.train.profiling import StepProfiler, recorded_steps

    profiler = StepProfiler(out / f"{arch}-profile", first=1, steps=steps)
    summary = None
    for i in range(1, recorded_steps(steps) + 1):
        profiler.before_step(i)
        step()
        summary = profiler.after_step(i) or summary
    return summary


def measure(arch: str, args, device: str = "cuda") -> dict:
    from pipetrain.backend.adapters import injection
    from pipetrain.backend.models.checkpointing import apply_checkpointing

    cuda = device == "cuda"
    gc.collect()                          # the previous model's weights must be gone before the peak is reset
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.monotonic()
    adapter = build(arch, device, torch.bfloat16, args.size)
    dm = adapter.diffusion_model
    params_b = sum(p.numel() for p in dm.parameters()) / 1e9
    injection.inject(dm, injection.AdapterSpec(rank=32, alpha=32.0), adapter.lora_block_prefixes)
    layers = adapter.to_layers()
    apply_checkpointing(layers, args.checkpointing, args.checkpoint_fraction)
    if args.compile:
        adapter.compile(layers, checkpoint_inside=not args.compile_inside_checkpoint, memory_budget=args.memory_budget)
    trainable = injection.trainable_parameters(dm)
    opt = torch.optim.AdamW(trainable, lr=1e-5)
    # as the engine stores them (SDXL: channels-last); --channels-last forces it for any model
    dm.to(memory_format=torch.channels_last if args.channels_last else adapter.memory_format)
    inputs = batched(probe_inputs(adapter, args.resolution, args.frames, device, args.seconds), args.batch,
                     args.channels_last)
    built_s = time.monotonic() - t0
    times, losses = [], []
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for step in range(args.warmup + args.steps):
        sync()
        s = time.perf_counter()
        loss = _step(layers, inputs, adapter, opt)
        sync()
        if step >= args.warmup:
            times.append(time.perf_counter() - s)
        losses.append(float(loss))
    step_s = statistics.median(times)
    profiled = profile_steps(arch, lambda: _step(layers, inputs, adapter, opt), Path(args.out)) if args.profile else {}
    return {**profiled, "arch": arch, "params_b": round(params_b, 2), "lora_m": round(sum(p.numel() for p in trainable) / 1e6, 1),
            "latent": list(inputs[0].shape), "step_s": round(step_s, 4), "samples_per_s": round(args.batch / step_s, 3),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None, "build_s": round(built_s, 1),
            "finite": all(map(lambda v: v == v and abs(v) != float("inf"), losses))}


def main() -> int:
    from pipetrain.backend.models.registry import ADAPTERS
    from pipetrain.backend.host.runtime import ensure_comfyui

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--archs", default=",".join(ADAPTERS))
    p.add_argument("--out", default="bench-out")
    p.add_argument("--size", default="full")
    p.add_argument("--resolution", type=int, default=1024)
    p.add_argument("--frames", type=int, default=33)
    p.add_argument("--seconds", type=float, default=60.0, help="audio models (ace_step): the clip's length")
    p.add_argument("--batch", type=int, default=1, help="samples per step (the probe, repeated)")
    p.add_argument("--channels-last", action="store_true",
                   help="4-D weights and latents stored NHWC for every model (default: the adapter's format)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--checkpoint-fraction", type=float, default=1.0, help="checkpoint this share of the blocks")
    p.add_argument("--memory-budget", type=float, help="with --compile: activation_memory_budget (share kept)")
    p.add_argument("--compile-inside-checkpoint", action="store_true",
                   help="compile each block inside an eager checkpoint (the older placement, for comparison)")
    p.add_argument("--deadline-s", type=float, default=1e9)
    p.add_argument("--profile", action="store_true", help="also record two steps with torch.profiler and sample two on the host")
    args = p.parse_args()
    ensure_comfyui()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start, results = time.monotonic(), {}
    device = "cuda" if torch.cuda.is_available() else "cpu"   # the CPU: a smoke test of the code paths (--size tiny)
    for arch in args.archs.split(","):
        if time.monotonic() - start > args.deadline_s:
            results[arch] = {"skipped": "deadline"}
            continue
        try:
            results[arch] = measure(arch, args, device)
        except Exception as e:  # noqa: BLE001  (one model's failure must not hide the others)
            results[arch] = {"error": f"{type(e).__name__}: {str(e)[:300]}", "peak_gib": round(
                torch.cuda.max_memory_allocated() / 2**30, 1) if device == "cuda" else None}
        print(json.dumps(results[arch]), flush=True)
        (out / "models.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
        if device == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
