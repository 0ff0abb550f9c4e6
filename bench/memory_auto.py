# SPDX-License-Identifier: GPL-3.0-or-later
"""``memory = "auto"`` on a GPU capped to a consumer card's memory: does the plan's choice train where the
defaults run out of memory, and how close is the planned peak to the measured one?

Each case runs in its own process: the published-size model built on the GPU with random weights (as
``bench/models.py``), LoRA rank 32 in float32 with AdamW, then the memory settings (the trainer's defaults,
or what ``memory_plan.choose`` picks for the cap, traced on the meta device at the same micro-batch), then
``torch.cuda.set_per_process_memory_fraction`` caps what PyTorch may allocate from there on, and a few steps run.

    python bench/memory_auto.py --out $OUT [--cases flux-1024,wan-480x832x33,qwen_image-1024] [--caps 24,16]

Writes ``memory_auto.json`` after every case: cap, settings, planned and measured peak, step time, or the OOM.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CASES = {"flux-1024": ("flux", 1024, 1024, 1), "wan-480x832x33": ("wan", 832, 480, 33),
         "qwen_image-1024": ("qwen_image", 1024, 1024, 1), "sd15-512": ("sd15", 512, 512, 1)}


def _settings_for(adapter_arch, width, height, frames, cap_gib, mode):
    import torch

    from pipetrain.backend.adapters import injection
    from pipetrain.backend.memory import plan as mp
    from pipetrain.backend.config import ModelConfig
    from pipetrain.backend.models import loading
    from pipetrain.backend.models.meta_trace import probe_inputs, to_meta_where_large, trace_layers
    from pipetrain.backend.models.registry import adapter_class, arch_spec

    patcher = loading.build_model(adapter_arch, arch_spec(adapter_arch).unet_config("full"), torch.bfloat16, "meta")
    adapter = adapter_class(adapter_arch)(ModelConfig(type=adapter_arch, diffusion_model="unused", vae="unused",
                                                      dtype="bfloat16"))
    adapter.use_model(patcher)
    injection.inject(adapter.diffusion_model, injection.AdapterSpec(rank=32, alpha=32.0), adapter.lora_block_prefixes)
    footprints = trace_layers(adapter.to_layers(), to_meta_where_large(probe_inputs(adapter, width, height, frames)))
    training = mp.Training()
    if mode == "defaults":
        settings = mp.MemorySettings()
    else:
        chosen = mp.choose(footprints, training, int(cap_gib * mp.GIB), whole_gpu=False)
        if chosen is None:
            return None, None
        settings = chosen[0]
    [stage] = mp.estimate(footprints, settings, training)
    return settings, stage.gpu / mp.GIB


def one_case(case: str, cap_gib: float, mode: str, steps: int) -> dict:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from models import build

    from pipetrain.backend.adapters import injection
    from pipetrain.backend.models.checkpointing import apply_checkpointing
    from pipetrain.backend.models.meta_trace import probe_inputs
    from pipetrain.backend.train.swap import BlockSwapper, swappable_module

    arch, width, height, frames = CASES[case]
    settings, planned = _settings_for(arch, width, height, frames, cap_gib, mode)
    result = {"case": case, "cap_gib": cap_gib, "mode": mode, "planned_gib": planned and round(planned, 2),
              "settings": settings and settings.describe()}
    if settings is None:
        return {**result, "outcome": "plan: nothing fits"}
    adapter = build(arch, "cuda", torch.bfloat16, "full")
    dm = adapter.diffusion_model
    injection.inject(dm, injection.AdapterSpec(rank=32, alpha=32.0), adapter.lora_block_prefixes)
    layers = adapter.to_layers()
    apply_checkpointing(layers, settings.activation_checkpointing, settings.activation_checkpointing_fraction)
    if settings.blocks_to_swap:
        blocks = [layer for layer in layers if swappable_module(layer) is not None]
        chosen = blocks[len(blocks) - settings.blocks_to_swap:]
        BlockSwapper([swappable_module(layer) for layer in chosen], torch.device("cuda")).attach(chosen)
    opt = torch.optim.AdamW(injection.trainable_parameters(dm), lr=1e-5)
    inputs = tuple(x.cuda() for x in probe_inputs(adapter, width, height, frames))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2 ** 30 / total))
    torch.cuda.reset_peak_memory_stats()
    times = []
    try:
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            h = inputs
            for layer in layers:
                h = layer(h)
            adapter.loss(h, inputs[:3]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    except torch.OutOfMemoryError:
        return {**result, "outcome": "out of memory", "steps_done": len(times),
                "weights_gib": round(torch.cuda.memory_allocated() / 2 ** 30, 2)}
    return {**result, "outcome": "trained", "peak_gib": round(torch.cuda.max_memory_allocated() / 2 ** 30, 2),
            "step_s": round(statistics.median(times[1:] or times), 3)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--cases", default="flux-1024,wan-480x832x33,qwen_image-1024")
    p.add_argument("--caps", default="24,16")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout-s", type=float, default=240)
    p.add_argument("--one", nargs=3, metavar=("CASE", "CAP", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        case, cap, mode = args.one
        print("RESULT " + json.dumps(one_case(case, float(cap), mode, args.steps)), flush=True)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for case in args.cases.split(","):
        for cap in (float(c) for c in args.caps.split(",")):
            for mode in ("defaults", "auto"):
                t0 = time.monotonic()
                try:
                    done = subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--one", case,
                                           str(cap), mode], capture_output=True, text=True, timeout=args.timeout_s)
                    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
                    result = json.loads(line[7:]) if line else {"case": case, "cap_gib": cap, "mode": mode,
                                                                 "outcome": "failed", "log": done.stderr[-1500:]}
                except subprocess.TimeoutExpired:
                    result = {"case": case, "cap_gib": cap, "mode": mode, "outcome": "timed out"}
                result["wall_s"] = round(time.monotonic() - t0, 1)
                results.append(result)
                print(json.dumps(result), flush=True)
                (out / "memory_auto.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
