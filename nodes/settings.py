# SPDX-License-Identifier: GPL-3.0-or-later
"""Small setting nodes whose outputs feed Train: Adapter, Optimizer, Schedule, Parallelism, Memory."""
from __future__ import annotations

from comfy_api.latest import io

from ..launcher.specs import AdapterSpec, MemorySpec, OptimizerSpec, ParallelismSpec, ScheduleSpec
from . import types as t


def _words(text: str) -> tuple[str, ...]:
    return tuple(w.strip() for w in text.replace(";", ",").split(",") if w.strip())


class AdapterNode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="PipeTrainAdapter", display_name="PipeTrain LoRA Adapter", category=t.CATEGORY,
            inputs=[
                io.Int.Input("rank", default=16, min=1, max=1024, tooltip="LoRA rank: capacity of the adapter"),
                io.Float.Input("alpha", default=0.0, min=0.0, max=4096.0, step=1.0, tooltip="LoRA alpha; the update "
                               "is scaled by alpha/rank. 0 means alpha = rank (scale 1)"),
                io.Float.Input("dropout", default=0.0, min=0.0, max=0.99, step=0.01, tooltip="Dropout on the LoRA "
                               "input during training"),
                io.String.Input("target_modules", default="", tooltip="Comma-separated module name patterns to adapt; "
                                "empty: the model's default attention and MLP layers"),
            ],
            outputs=[t.Adapter.Output(display_name="adapter")],
        )

    @classmethod
    def execute(cls, rank, alpha, dropout, target_modules) -> io.NodeOutput:
        return io.NodeOutput(AdapterSpec(rank, alpha or None, dropout, _words(target_modules) or None))


class OptimizerNode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="PipeTrainOptimizer", display_name="PipeTrain Optimizer", category=t.CATEGORY,
            inputs=[
                io.Combo.Input("type", options=["adamw", "adamw_optimi", "sgd"], default="adamw",
                               tooltip="Optimizer algorithm"),
                io.Float.Input("lr", default=2e-4, min=1e-8, max=1.0, step=1e-5, round=1e-8, tooltip="Peak learning rate"),
                io.Float.Input("beta1", default=0.9, min=0.0, max=0.9999, step=0.001, tooltip="Adam beta1 (momentum)"),
                io.Float.Input("beta2", default=0.99, min=0.0, max=0.99999, step=0.001, tooltip="Adam beta2"),
                io.Float.Input("weight_decay", default=0.01, min=0.0, max=1.0, step=0.001, tooltip="Decoupled weight "
                               "decay"),
                io.Float.Input("eps", default=1e-8, min=1e-12, max=1e-3, step=1e-9, round=1e-12, tooltip="Adam epsilon"),
            ],
            outputs=[t.Optimizer.Output(display_name="optimizer")],
        )

    @classmethod
    def execute(cls, type, lr, beta1, beta2, weight_decay, eps) -> io.NodeOutput:  # noqa: A002
        return io.NodeOutput(OptimizerSpec(type, lr, (beta1, beta2), weight_decay, eps))


class ScheduleNode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="PipeTrainSchedule", display_name="PipeTrain Schedule", category=t.CATEGORY,
            inputs=[
                io.Int.Input("epochs", default=10, min=1, max=100000, tooltip="Passes over the dataset"),
                io.Combo.Input("lr_scheduler", options=["constant", "linear", "cosine"], default="constant",
                               tooltip="Learning-rate curve after warm-up"),
                io.Int.Input("warmup_steps", default=0, min=0, max=1000000, tooltip="Steps of linear LR warm-up"),
                io.Int.Input("save_every_n_epochs", default=1, min=1, max=10000, tooltip="Write an epoch LoRA into "
                             "models/loras/pipetrain/<run> every N epochs"),
                io.Int.Input("checkpoint_every_n_epochs", default=0, min=0, max=10000, tooltip="Save a resumable "
                             "checkpoint every N epochs (0: off)"),
                io.Float.Input("checkpoint_every_n_minutes", default=30.0, min=0.0, max=10000.0, step=1.0,
                               tooltip="Save a resumable checkpoint every N minutes (0: off)"),
                io.Int.Input("seed", default=42, min=0, max=2**31 - 1, tooltip="Random seed of the run"),
            ],
            outputs=[t.Schedule.Output(display_name="schedule")],
        )

    @classmethod
    def execute(cls, epochs, lr_scheduler, warmup_steps, save_every_n_epochs, checkpoint_every_n_epochs,
                checkpoint_every_n_minutes, seed) -> io.NodeOutput:
        return io.NodeOutput(ScheduleSpec(epochs, lr_scheduler, warmup_steps, save_every_n_epochs,
                                          checkpoint_every_n_epochs or None, checkpoint_every_n_minutes or None, seed))


def parse_gpu_ids(text: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(w) for w in _words(text))
    except ValueError:
        raise ValueError(f"gpu_ids {text!r}: write GPU indices separated by commas, e.g. 0,1") from None
    if len(set(ids)) != len(ids) or any(i < 0 for i in ids):
        raise ValueError(f"gpu_ids {text!r}: each GPU index once, 0 or more")
    return ids


class ParallelismNode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="PipeTrainParallelism", display_name="PipeTrain Parallelism", category=t.CATEGORY,
            inputs=[
                io.Int.Input("gpus", default=1, min=1, max=64, tooltip="Number of GPUs (DeepSpeed ranks) for the run"),
                io.Int.Input("pipeline_stages", default=1, min=1, max=64, tooltip="Split the model over this many "
                             "GPUs; must divide gpus (the rest is data parallel)"),
                io.Int.Input("micro_batch_size_per_gpu", default=1, min=1, max=256, tooltip="Images per micro batch"),
                io.Int.Input("gradient_accumulation_steps", default=1, min=1, max=1024, tooltip="Micro batches per "
                             "optimizer step"),
                io.String.Input("gpu_ids", default="", tooltip="Which GPUs, e.g. 2,3 (empty: the first `gpus` ones)"),
            ],
            outputs=[t.Parallelism.Output(display_name="parallelism")],
        )

    @classmethod
    def validate_inputs(cls, gpus=None, pipeline_stages=None, gpu_ids=None):
        stages = pipeline_stages
        if gpus is not None and stages is not None and gpus % stages:
            return (f"pipeline_stages={stages} does not divide gpus={gpus}; use a GPU count that is a multiple of "
                    f"{stages}")
        try:
            ids = parse_gpu_ids(gpu_ids or "")
        except ValueError as e:
            return str(e)
        if ids and gpus is not None and len(ids) != gpus:
            return f"gpu_ids lists {len(ids)} GPUs but gpus={gpus}"
        return True

    @classmethod
    def execute(cls, gpus, pipeline_stages, micro_batch_size_per_gpu, gradient_accumulation_steps,
                gpu_ids) -> io.NodeOutput:
        return io.NodeOutput(ParallelismSpec(gpus, parse_gpu_ids(gpu_ids), pipeline_stages, micro_batch_size_per_gpu,
                                             gradient_accumulation_steps))


class MemoryNode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="PipeTrainMemory", display_name="PipeTrain Memory", category=t.CATEGORY,
            inputs=[
                io.Boolean.Input("activation_checkpointing", default=True, tooltip="Recompute activations in the "
                                 "backward pass: much less memory, ~30% slower"),
                io.Int.Input("blocks_to_swap", default=0, min=0, max=200, tooltip="Transformer blocks kept in CPU "
                             "memory and swapped in when needed (0: off)"),
            ],
            outputs=[t.Memory.Output(display_name="memory")],
        )

    @classmethod
    def execute(cls, activation_checkpointing, blocks_to_swap) -> io.NodeOutput:
        return io.NodeOutput(MemorySpec(activation_checkpointing, blocks_to_swap))
