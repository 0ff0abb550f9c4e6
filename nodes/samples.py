# SPDX-License-Identifier: GPL-3.0-or-later
"""Samples: prompts rendered with ComfyUI's own sampler and every saved epoch LoRA ([samples])."""
from __future__ import annotations

from comfy_api.latest import io

from ..launcher.specs import SamplesSpec
from . import types as t


def parse_prompts(text: str) -> tuple[str, ...]:
    """One prompt a line; blank lines are skipped."""
    prompts = tuple(line.strip() for line in (text or "").splitlines() if line.strip())
    if not prompts:
        raise ValueError("write at least one prompt (one a line)")
    return prompts


class SamplesNode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        import comfy.samplers
        return io.Schema(
            node_id="PipeTrainSamples", display_name="PipeTrain Samples", category=t.CATEGORY,
            description="Sample images rendered after every saved epoch with the fresh LoRA (ComfyUI's sampler); "
                        "they land beside the LoRA and show in the panel and TensorBoard.",
            inputs=[
                io.String.Input("prompts", default="", multiline=True, tooltip="One prompt a line"),
                io.String.Input("negative_prompt", default="", multiline=True, tooltip="Negative prompt (used "
                                "when cfg > 1)"),
                io.Int.Input("seed", default=0, min=0, max=2**63 - 1, tooltip="Noise seed (the same for every "
                             "epoch, so the images are comparable)"),
                io.Int.Input("width", default=1024, min=16, max=8192, step=16, tooltip="Image width"),
                io.Int.Input("height", default=1024, min=16, max=8192, step=16, tooltip="Image height"),
                io.Int.Input("steps", default=20, min=1, max=1000, tooltip="Sampling steps"),
                io.Float.Input("cfg", default=1.0, min=0.0, max=100.0, step=0.1, round=0.01,
                               tooltip="Classifier-free guidance scale (Flux-dev: 1, with guidance below)"),
                io.Float.Input("guidance", default=3.5, min=0.0, max=100.0, step=0.1, round=0.01,
                               tooltip="Flux-dev's distilled guidance input"),
                io.Combo.Input("sampler", options=comfy.samplers.KSampler.SAMPLERS, default="euler",
                               tooltip="ComfyUI sampler"),
                io.Combo.Input("scheduler", options=comfy.samplers.KSampler.SCHEDULERS, default="simple",
                               tooltip="ComfyUI scheduler"),
            ],
            outputs=[t.Samples.Output(display_name="samples")],
        )

    @classmethod
    def validate_inputs(cls, prompts=None):
        if prompts is not None:
            try:
                parse_prompts(prompts)
            except ValueError as e:
                return str(e)
        return True

    @classmethod
    def execute(cls, prompts, negative_prompt, seed, width, height, steps, cfg, guidance, sampler,
                scheduler) -> io.NodeOutput:
        return io.NodeOutput(SamplesSpec(parse_prompts(prompts), negative_prompt, seed, width, height, steps, cfg,
                                         guidance, sampler, scheduler))
