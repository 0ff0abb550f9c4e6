# SPDX-License-Identifier: GPL-3.0-or-later
"""Cache and Train: the two output nodes that do something (through the launcher)."""
from __future__ import annotations

import logging
import time

from comfy_api.latest import io, ui

from ..backend.errors import PipeTrainError
from ..backend.config.patch import RunPatch
from ..launcher.specs import LORA, ParallelismSpec, RunHandle, TrainSpec
from . import types as t
from .declared import CheckedNode

log = logging.getLogger("pipetrain")


class CacheNode(CheckedNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="PipeTrainCache", display_name="PipeTrain Cache", category=t.CATEGORY, is_output_node=True,
            description="Encode the dataset's latents and caption embeddings once, with ComfyUI's progress bar. "
                        "Queued again with nothing changed it finishes at once.",
            inputs=[
                t.Dataset.Input("dataset", tooltip="The dataset to encode"),
                t.Model.Input("model", tooltip="The model whose VAE and text encoders encode it"),
            ],
            outputs=[t.Dataset.Output(display_name="dataset")],
        )

    @classmethod
    def execute(cls, dataset, model) -> io.NodeOutput:
        import comfy.model_management as mm
        import comfy.utils

        from ..launcher import comfy as host
        from ..launcher.cache_job import run_cache

        bars: dict[str, comfy.utils.ProgressBar] = {}

        def progress(kind: str, done: int, total: int) -> None:
            bar = bars.setdefault(kind, comfy.utils.ProgressBar(max(total, 1)))
            bar.update_absolute(done, max(total, 1))

        spec = TrainSpec(dataset, model)
        host.free_models((0,))
        start = time.monotonic()
        try:
            result = run_cache(spec, host.runs_root(), comfyui_root=host.comfyui_root(), progress=progress,
                               cancelled=mm.processing_interrupted)
        except PipeTrainError as e:
            if mm.processing_interrupted():   # Cancel: ComfyUI's own "interrupted", the child gone and reaped
                log.info("pipetrain: %s", e)
                mm.throw_exception_if_processing_interrupted()
            raise RuntimeError(str(e)) from None
        text = (f"cache ready: {result.get('entries', '?')} entries; encoded now: "
                f"{result.get('latents_encoded', 0)} latents, {result.get('texts_encoded', 0)} captions "
                f"({time.monotonic() - start:.1f} s)")
        return io.NodeOutput(dataset, ui=ui.PreviewText(text))


class TrainNode(CheckedNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="PipeTrainTrain", display_name="PipeTrain Train", category=t.CATEGORY, is_output_node=True,
            description="Validate the run, plan its GPU memory, write its folder and start training in a detached "
                        "process; returns in seconds and the queue stays free. Watch it in the PipeTrain panel.",
            inputs=[
                t.Dataset.Input("dataset", tooltip="Dataset (from PipeTrain Dataset or Cache)"),
                t.Model.Input("model", tooltip="Model files (from PipeTrain Model)"),
                t.Adapter.Input("adapter", optional=True, tooltip="LoRA settings (default: a LoRA as the Adapter "
                                "node starts)"),
                t.Optimizer.Input("optimizer", optional=True,
                                  tooltip="Optimizer settings (default: as the Optimizer node "
                                  "starts)"),
                t.Schedule.Input("schedule", optional=True, tooltip="Epochs, LR schedule, save and checkpoint "
                                 "frequency (default: as the Schedule node starts)"),
                t.Parallelism.Input("parallelism", optional=True, tooltip="GPUs, pipeline stages and batch "
                                    "(default: every GPU of this machine, stages chosen by the memory planner)"),
                t.Memory.Input("memory", optional=True, tooltip="Activation checkpointing and block swapping "
                               "(default: as the Memory node starts: neither)"),
                io.String.Input("run_name", default="lora", tooltip="Prefix of the run id; the run folder is "
                                "output/pipetrain/<run id> and its LoRAs models/loras/pipetrain/<run id>"),
                t.Dataset.Input("eval_dataset", optional=True, tooltip="Held-out images (a PipeTrain Dataset): eval "
                                "loss per timestep quantile, as often as the Schedule's eval_every_n_* say"),
                t.Samples.Input("samples", optional=True, tooltip="Prompts rendered with every saved epoch LoRA"),
            ],
            outputs=[t.Run.Output(display_name="run")],
        )

    @classmethod
    def execute(cls, dataset, model, run_name, adapter=None, optimizer=None, schedule=None, parallelism=None,
                memory=None, eval_dataset=None, samples=None) -> io.NodeOutput:
        from ..launcher.comfy import get_launcher

        from .settings import OptimizerNode

        # a settings input left unconnected is that node as it starts (its widgets' defaults)
        spec = TrainSpec(dataset, model, LORA if adapter is None else adapter,
                         OptimizerNode.defaults() if optimizer is None else optimizer,
                         RunPatch() if schedule is None else schedule, parallelism or ParallelismSpec(),
                         RunPatch() if memory is None else memory, eval_dataset, samples)
        start = time.monotonic()
        try:
            run_id = get_launcher().start(spec, run_name)
        except PipeTrainError as e:
            raise ValueError(str(e)) from None
        elapsed = time.monotonic() - start
        where = get_launcher().where(run_id)   # GPUs and the ComfyUI that trains; nodes (no_ssh: their commands)
        text = f"started run {run_id} in {elapsed:.2f} s {where}\n{get_launcher().queue_plan(run_id)}"
        return io.NodeOutput(RunHandle(run_id), ui=ui.PreviewText(text))
