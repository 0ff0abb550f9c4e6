# SPDX-License-Identifier: GPL-3.0-or-later
"""The memory plan against the peaks the H200 benchmarks recorded (``bench/results/h200-2026-12-03.json``:
``bench/models.py --checkpointing``, every block checkpointed, LoRA rank 32 in float32 with AdamW, one GPU):
the published-size model traced on the meta device, at the benchmark's resolution and frames, must come within
10% of the measured ``torch.cuda.max_memory_allocated``."""
import json
from pathlib import Path

import pytest
import torch

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "h200-2026-12-03.json"
JOBS = {"images_1024_checkpointing": ["flux_kontext", "z_image", "hunyuan_image_21", "omnigen2", "flux2"],
        "videos_512x33_checkpointing": ["wan", "wan_i2v"]}
CASES = [(job, arch) for job, archs in JOBS.items() for arch in archs]


def _estimate(arch: str, resolution: int, frames: int) -> float:
    from pipetrain.backend import lora
    from pipetrain.backend import memory_plan as mp
    from pipetrain.backend.config import ModelConfig
    from pipetrain.backend.models import loading
    from pipetrain.backend.models.meta_trace import probe_inputs, to_meta_where_large, trace_layers
    from pipetrain.backend.models.registry import adapter_class, arch_spec

    patcher = loading.build_model(arch, arch_spec(arch).unet_config("full"), torch.bfloat16, "meta")
    adapter = adapter_class(arch)(ModelConfig(type=arch, diffusion_model="unused", vae="unused", dtype="bfloat16"))
    adapter.use_model(patcher)
    lora.inject(adapter.diffusion_model, lora.LoRASpec(rank=32, alpha=32.0), adapter.lora_block_prefixes)
    inputs = probe_inputs(adapter, resolution, resolution, frames)
    footprints = trace_layers(adapter.to_layers(), to_meta_where_large(inputs))
    [stage] = mp.estimate(footprints, mp.MemorySettings(True), mp.Training())
    return stage.gpu / mp.GIB


@pytest.mark.parametrize("job,arch", CASES, ids=[a for _, a in CASES])
def test_planned_peak_is_within_ten_percent_of_the_h200s(job, arch):
    recorded = json.loads(RESULTS.read_text())["models"][job]
    args, measured = recorded["args"], recorded["results"][arch]["peak_gib"]
    planned = _estimate(arch, args["resolution"], args["frames"])
    assert abs(planned - measured) <= 0.10 * measured, f"{arch}: planned {planned:.2f} GiB, measured {measured} GiB"
