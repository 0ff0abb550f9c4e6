# SPDX-License-Identifier: GPL-3.0-or-later
"""The memory plan against the peaks the GPU benchmarks recorded (``bench/results/h200-2026-12-03.json``:
``bench/models.py --checkpointing``, every block checkpointed; ``h100-2026-12-05.json``: ``bench/run.py``'s video
cases and Flux-dev with ``fp8_compute``; LoRA rank 32 in float32 with AdamW, one GPU): the published-size model
traced on the meta device, at the benchmark's resolution and frames, must come within 10% of the measured
``torch.cuda.max_memory_allocated``."""
import functools
import json
from pathlib import Path

import pytest
import torch

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "h200-2026-12-03.json"
RUN_RESULTS = RESULTS.with_name("h100-2026-12-05.json")
JOBS = {"images_1024_checkpointing": ["flux_kontext", "z_image", "hunyuan_image_21", "omnigen2", "flux2"],
        "videos_512x33_checkpointing": ["wan", "wan_i2v"]}
CASES = [(job, arch) for job, archs in JOBS.items() for arch in archs]


@functools.cache
def _footprints(arch: str, resolution: int, frames: int) -> tuple:
    """The traced layers of the published-size model at that size (LoRA rank 32): they do not depend on the
    checkpointing or fp8 settings the estimate applies, so cases of one model and size trace it once."""
    from pipetrain.backend.adapters import injection
    from pipetrain.backend.config import ModelConfig
    from pipetrain.backend.models import loading
    from pipetrain.backend.models.meta_trace import probe_inputs, to_meta_where_large, trace_layers
    from pipetrain.backend.models.registry import adapter_class, arch_spec

    patcher = loading.build_model(arch, arch_spec(arch).unet_config("full"), torch.bfloat16, "meta")
    adapter = adapter_class(arch)(ModelConfig(type=arch, diffusion_model="unused", vae="unused", dtype="bfloat16"))
    adapter.use_model(patcher)
    injection.inject(adapter.diffusion_model, injection.AdapterSpec(rank=32, alpha=32.0), adapter.lora_block_prefixes)
    inputs = probe_inputs(adapter, resolution, resolution, frames)
    return tuple(trace_layers(adapter.to_layers(), to_meta_where_large(inputs)))


def _estimate(arch: str, resolution: int, frames: int, checkpointing=True, fp8_compute: bool = False) -> float:
    from pipetrain.backend.memory import plan as mp

    footprints = list(_footprints(arch, resolution, frames))
    [stage] = mp.estimate(footprints, mp.MemorySettings(checkpointing), mp.Training(fp8_compute=fp8_compute))
    return stage.gpu / mp.GIB


@pytest.mark.parametrize("job,arch", CASES, ids=[a for _, a in CASES])
def test_planned_peak_is_within_ten_percent_of_the_h200s(job, arch):
    recorded = json.loads(RESULTS.read_text())["models"][job]
    args, measured = recorded["args"], recorded["results"][arch]["peak_gib"]
    planned = _estimate(arch, args["resolution"], args["frames"])
    assert abs(planned - measured) <= 0.10 * measured, f"{arch}: planned {planned:.2f} GiB, measured {measured} GiB"


RUN_CASES = ["wan14b-480x832x33-ckpt", "hunyuan_video-544x960x33-ckpt", "flux-1024-selective-compile-fp8",
             pytest.param("flux-1024-ckpt-compile-fp8", marks=pytest.mark.xfail(
                 strict=True, reason="true + fp8_compute measured 27.8 GiB where the plan says 15.6: not explained"))]


@pytest.mark.parametrize("name", RUN_CASES)
def test_planned_peak_is_within_ten_percent_of_bench_runs(name):
    results = {k: v for job in json.loads(RUN_RESULTS.read_text())["jobs"] for k, v in job["results"].items()}
    case, measured = results[name]["case"], results[name]["ours"]["peak_gib"]
    planned = _estimate(case["arch"], case["resolution"], case["frames"], case["checkpointing"],
                        case["fp8_compute"])
    assert abs(planned - measured) <= 0.10 * measured, f"{name}: planned {planned:.2f} GiB, measured {measured} GiB"
