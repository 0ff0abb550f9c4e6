# SPDX-License-Identifier: GPL-3.0-or-later
"""Small setting nodes whose outputs feed Train: Adapter, Optimizer, Schedule, Parallelism, Memory."""
from __future__ import annotations

from pathlib import Path

from comfy_api.latest import io

from ..backend.errors import PipeTrainError
from ..launcher.build import checkpointing_mode
from ..launcher.cluster import FLAGS, LAUNCHERS, OFF, check_cluster, cluster_form
from ..launcher.specs import AdapterSpec, MemorySpec, OptimizerSpec, ParallelismSpec, ScheduleSpec
from . import types as t


def _words(text: str) -> tuple[str, ...]:
    return tuple(w.strip() for w in text.replace(";", ",").split(",") if w.strip())


ADAPTER_TYPES = ("lora", "lokr", "full")   # full: no [adapter] table, every weight trains


class AdapterNode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="PipeTrainAdapter", display_name="PipeTrain LoRA Adapter", category=t.CATEGORY,
            inputs=[
                io.Int.Input("rank", default=16, min=1, max=1000000, tooltip="LoRA rank: capacity of the adapter "
                             "(LoKr: the rank of its second Kronecker factor; a huge rank such as 1000000 makes "
                             "it a full matrix)"),
                io.Float.Input("alpha", default=0.0, min=0.0, max=4096.0, step=1.0, tooltip="LoRA alpha; the update "
                               "is scaled by alpha/rank. 0 means alpha = rank (scale 1)"),
                io.Float.Input("dropout", default=0.0, min=0.0, max=0.99, step=0.01, tooltip="Dropout on the LoRA "
                               "input during training"),
                io.String.Input("target_modules", default="", tooltip="Comma-separated module name patterns to adapt; "
                                "empty: the model's default attention and MLP layers"),
                io.Combo.Input("type", options=list(ADAPTER_TYPES), default="lora", optional=True, tooltip="lora; "
                               "lokr (LyCORIS Kronecker product, saved with ComfyUI's LoKr keys); or full: no adapter, "
                               "every weight of the diffusion model trains and each epoch saves a whole model "
                               "(<run>/models); needs far more memory: see the README's Memory section"),
                io.Int.Input("decompose_factor", default=-1, min=-1, max=65536, optional=True, tooltip="LoKr: size "
                             "of the first Kronecker factor's sides (-1: as square as possible)"),
            ],
            outputs=[t.Adapter.Output(display_name="adapter")],
        )

    @classmethod
    def validate_inputs(cls, type=None, decompose_factor=None):  # noqa: A002
        if decompose_factor == 0:
            return "decompose_factor: give 1 or more, or -1 (as square as possible)"
        if decompose_factor not in (None, -1) and type not in (None, "lokr"):
            return "decompose_factor is a LoKr option: set type to lokr, or decompose_factor to -1"
        return True

    @classmethod
    def execute(cls, rank, alpha, dropout, target_modules, type="lora",  # noqa: A002
                decompose_factor=-1) -> io.NodeOutput:
        return io.NodeOutput(AdapterSpec(rank, alpha or None, dropout, _words(target_modules) or None, type,
                                         decompose_factor))


OPTIMIZERS = ["adamw", "adamw8bit", "AdamW8bitKahan", "adamw_optimi", "stableadamw", "sgd", "Prodigy", "CAME",
              "ADOPT",
              "ScheduleFreeAdamW", "Lion"]
NO_BETAS = {"sgd"}


def _hashable(value):
    if isinstance(value, dict):
        raise ValueError("nested tables are not optimizer arguments")
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value


def parse_kwargs(text: str) -> tuple[tuple[str, object], ...]:
    """``d_coef = 2, decouple = true`` (or one ``key = value`` a line, TOML values) -> sorted (key, value) pairs."""
    import tomllib
    text = (text or "").strip()
    if not text:
        return ()
    try:
        table = tomllib.loads(f"t = {{{text}}}")["t"] if "\n" not in text else tomllib.loads(text)
        return tuple(sorted((k, _hashable(v)) for k, v in table.items()))
    except (tomllib.TOMLDecodeError, ValueError) as e:
        raise ValueError(f"extra_args {text!r}: write key = value pairs with TOML values separated by commas or "
                         f"lines, e.g. d_coef = 2, decouple = true ({e})") from None


class OptimizerNode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="PipeTrainOptimizer", display_name="PipeTrain Optimizer", category=t.CATEGORY,
            inputs=[
                io.Combo.Input("type", options=OPTIMIZERS, default="adamw", tooltip="Optimizer algorithm: adamw "
                               "(torch), adamw8bit (bitsandbytes), AdamW8bitKahan (8-bit AdamW with Kahan-compensated "
                               "bfloat16 weights: a full fine-tune or bfloat16 adapters), adamw_optimi / stableadamw "
                               "(torch-optimi), sgd, or a pytorch_optimizer class (Prodigy: set lr 1)"),
                io.Float.Input("lr", default=2e-4, min=1e-8, max=1.0, step=1e-5, round=1e-8, tooltip="Peak learning rate"),
                io.Float.Input("beta1", default=0.9, min=0.0, max=0.9999, step=0.001, tooltip="Adam beta1 (momentum)"),
                io.Float.Input("beta2", default=0.99, min=0.0, max=0.99999, step=0.001, tooltip="Adam beta2"),
                io.Float.Input("weight_decay", default=0.01, min=0.0, max=1.0, step=0.001, tooltip="Decoupled weight "
                               "decay"),
                io.Float.Input("eps", default=1e-8, min=1e-12, max=1e-3, step=1e-9, round=1e-12, tooltip="Adam epsilon"),
                io.String.Input("extra_args", default="", multiline=True, tooltip="More constructor arguments of the "
                                "optimizer as TOML key = value pairs, e.g. d_coef = 2, decouple = true (Prodigy) or "
                                "momentum = 0.9 (sgd); checked against the optimizer when queued"),
            ],
            outputs=[t.Optimizer.Output(display_name="optimizer")],
        )

    @classmethod
    def validate_inputs(cls, extra_args=None):
        try:
            parse_kwargs(extra_args or "")
        except ValueError as e:
            return str(e)
        return True

    @classmethod
    def execute(cls, type, lr, beta1, beta2, weight_decay, eps, extra_args="") -> io.NodeOutput:  # noqa: A002
        return io.NodeOutput(OptimizerSpec(type, lr, (beta1, beta2), weight_decay, eps, parse_kwargs(extra_args),
                                           use_betas=type not in NO_BETAS))


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
                io.Int.Input("save_every_n_epochs", default=1, min=0, max=10000, tooltip="Write an epoch LoRA into "
                             "models/loras/pipetrain/<run> every N epochs (0: none, with save_every_n_steps set)"),
                io.Int.Input("checkpoint_every_n_epochs", default=0, min=0, max=10000, tooltip="Save a resumable "
                             "checkpoint every N epochs (0: off)"),
                io.Float.Input("checkpoint_every_n_minutes", default=30.0, min=0.0, max=10000.0, step=1.0,
                               tooltip="Save a resumable checkpoint every N minutes (0: off)"),
                io.Int.Input("seed", default=42, min=0, max=2**31 - 1, tooltip="Random seed of the run"),
                io.Int.Input("save_every_n_steps", default=0, min=0, max=10000000, tooltip="Also write a step LoRA "
                             "every N optimizer steps (0: off)"),
                io.Int.Input("eval_every_n_epochs", default=1, min=0, max=10000, tooltip="With an eval dataset on "
                             "Train: held-out loss at the end of every N-th epoch (0: off)"),
                io.Int.Input("eval_every_n_steps", default=0, min=0, max=10000000, tooltip="With an eval dataset on "
                             "Train: held-out loss every N steps (0: off)"),
            ],
            outputs=[t.Schedule.Output(display_name="schedule")],
        )

    @classmethod
    def validate_inputs(cls, save_every_n_epochs=None, save_every_n_steps=None):
        if save_every_n_epochs == 0 and save_every_n_steps == 0:
            return "nothing would be saved: set save_every_n_epochs or save_every_n_steps"
        return True

    @classmethod
    def execute(cls, epochs, lr_scheduler, warmup_steps, save_every_n_epochs, checkpoint_every_n_epochs,
                checkpoint_every_n_minutes, seed, save_every_n_steps=0, eval_every_n_epochs=1,
                eval_every_n_steps=0) -> io.NodeOutput:
        return io.NodeOutput(ScheduleSpec(epochs, lr_scheduler, warmup_steps, save_every_n_epochs or None,
                                          checkpoint_every_n_epochs or None, checkpoint_every_n_minutes or None, seed,
                                          save_every_n_steps or None, eval_every_n_epochs or None,
                                          eval_every_n_steps or None))


def parse_gpu_ids(text: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(w) for w in _words(text))
    except ValueError:
        raise ValueError(f"gpu_ids {text!r}: write GPU indices separated by commas, e.g. 0,1") from None
    if len(set(ids)) != len(ids) or any(i < 0 for i in ids):
        raise ValueError(f"gpu_ids {text!r}: each GPU index once, 0 or more")
    return ids


def hostfile_path(text: str | None) -> str:
    """A hostfile as typed: an absolute path, or a path under ComfyUI's input directory ('' stays '')."""
    text = (text or "").strip()
    if not text:
        return ""
    import folder_paths
    p = Path(text).expanduser()
    return str(p if p.is_absolute() else (Path(folder_paths.get_input_directory()) / p).resolve())


class ParallelismNode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="PipeTrainParallelism", display_name="PipeTrain Parallelism", category=t.CATEGORY,
            inputs=[
                io.Int.Input("gpus", default=1, min=1, max=64, tooltip="Number of GPUs (DeepSpeed ranks) for the run "
                             "on this machine; with a cluster the hosts' slots decide instead"),
                io.Int.Input("pipeline_stages", default=1, min=1, max=64, tooltip="Split the model over this many "
                             "GPUs; must divide gpus, or a cluster's total slots (the rest is data parallel)"),
                io.Int.Input("micro_batch_size_per_gpu", default=1, min=1, max=256, tooltip="Images per micro batch"),
                io.Int.Input("gradient_accumulation_steps", default=1, min=1, max=1024, tooltip="Micro batches per "
                             "optimizer step"),
                io.String.Input("gpu_ids", default="", tooltip="Which GPUs, e.g. 2,3 (empty: the first `gpus` ones); "
                                "one machine only"),
                io.Combo.Input("cluster", options=[OFF, *LAUNCHERS], default=OFF, optional=True, tooltip="Several "
                               "machines through DeepSpeed's launcher. off: this machine only. pdsh: DeepSpeed starts "
                               "every host over ssh. no_ssh: node 0 starts here and Train shows the command to run on "
                               "each other node. slurm: srun, from inside an allocation. openmpi: mpirun. The output "
                               "folder must be shared, and dataset and model files at the same paths, on every node"),
                io.String.Input("hostfile", default="", optional=True, tooltip="Cluster: a DeepSpeed hostfile, "
                                "'<host> slots=<gpus>' a line, node 0 first (an absolute path or one under ComfyUI's "
                                "input directory); or use hosts"),
                io.String.Input("hosts", default="", optional=True, tooltip="Cluster: or the hosts with their GPU "
                                "count, node 0 first, e.g. node-a:8, node-b:8"),
                io.String.Input("master_addr", default="", optional=True, tooltip="Cluster: the address of node 0 "
                                "that every node can reach (required for no_ssh)"),
                io.Int.Input("master_port", default=29500, min=1, max=65535, optional=True, tooltip="Cluster: the "
                             "TCP port on node 0 where the ranks meet"),
                io.String.Input("env", default="", multiline=True, optional=True, tooltip="Cluster: environment "
                                "variables for every node, KEY=VALUE a line (e.g. HF_HOME=/shared/hf)"),
                io.String.Input("nccl_socket_ifname", default="", optional=True, tooltip="Cluster: "
                                "NCCL_SOCKET_IFNAME, the network interface NCCL uses, e.g. eth0 (empty: NCCL picks)"),
                io.Combo.Input("nccl_ib_disable", options=list(FLAGS), default="default", optional=True,
                               tooltip="Cluster: NCCL_IB_DISABLE; true turns InfiniBand off (default: not set)"),
                io.Combo.Input("nccl_p2p_disable", options=list(FLAGS), default="default", optional=True,
                               tooltip="Cluster: NCCL_P2P_DISABLE; true turns GPU peer-to-peer off (default: not set)"),
            ],
            outputs=[t.Parallelism.Output(display_name="parallelism")],
        )

    @classmethod
    def validate_inputs(cls, gpus=None, pipeline_stages=None, gpu_ids=None, cluster=None, hostfile=None, hosts=None,
                        master_addr=None, master_port=None, env=None):
        stages = pipeline_stages
        try:
            ids = parse_gpu_ids(gpu_ids or "")
        except ValueError as e:
            return str(e)
        if cluster not in (None, OFF):
            if ids:
                return f"gpu_ids {gpu_ids!r} apply to one machine; on a cluster each host uses its first <slots> GPUs"
            try:  # the hosts (hostfile read now), the backend's [cluster] rules, stages vs. total slots
                spec = cluster_form(cluster, hostfile=hostfile_path(hostfile), hosts=hosts or "",
                                    master_addr=master_addr or "", env=env or "",
                                    master_port=29500 if master_port is None else master_port)
                if stages is not None:
                    check_cluster(spec, stages)
            except (PipeTrainError, ValueError) as e:
                return str(e)
            return True
        if gpus is not None and stages is not None and gpus % stages:
            return (f"pipeline_stages={stages} does not divide gpus={gpus}; use a GPU count that is a multiple of "
                    f"{stages}")
        if ids and gpus is not None and len(ids) != gpus:
            return f"gpu_ids lists {len(ids)} GPUs but gpus={gpus}"
        return True

    @classmethod
    def execute(cls, gpus, pipeline_stages, micro_batch_size_per_gpu, gradient_accumulation_steps, gpu_ids,
                cluster=OFF, hostfile="", hosts="", master_addr="", master_port=29500, env="", nccl_socket_ifname="",
                nccl_ib_disable="default", nccl_p2p_disable="default") -> io.NodeOutput:
        spec = cluster_form(cluster, hostfile=hostfile_path(hostfile), hosts=hosts, master_addr=master_addr,
                            master_port=master_port, env=env, nccl_socket_ifname=nccl_socket_ifname,
                            nccl_ib_disable=nccl_ib_disable, nccl_p2p_disable=nccl_p2p_disable)
        return io.NodeOutput(ParallelismSpec(gpus, parse_gpu_ids(gpu_ids), pipeline_stages, micro_batch_size_per_gpu,
                                             gradient_accumulation_steps, spec))


class MemoryNode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="PipeTrainMemory", display_name="PipeTrain Memory", category=t.CATEGORY,
            inputs=[
                io.Boolean.Input("activation_checkpointing", default=True, tooltip="Recompute activations in the "
                                 "backward pass: much less memory, ~30% slower"),
                io.Int.Input("blocks_to_swap", default=0, min=0, max=200, tooltip="Per pipeline stage: this many "
                             "transformer blocks keep their frozen weights in CPU memory and are copied to the "
                             "GPU just before use (0: off). Less GPU memory, slower steps; fewer than a stage's "
                             "blocks; adapters only (not a full fine-tune)"),
                io.Boolean.Input("offload_activations", default=False, tooltip="With activation checkpointing: keep "
                                 "each block's saved inputs in CPU memory too (diffusion-pipe's 'unsloth'; a little "
                                 "less GPU memory, a little slower)"),
                io.Boolean.Input("compile", default=False, optional=True, tooltip="torch.compile each transformer "
                                 "block: faster steps on a GPU (Flux-dev on an H200: +39%), the first step waits "
                                 "about a minute for the compile"),
                io.Float.Input("checkpoint_fraction", default=1.0, min=0.05, max=1.0, step=0.05, optional=True,
                               tooltip="With activation checkpointing: the share of blocks checkpointed, evenly "
                               "spread (1: all). Lower is faster and takes more memory; pick the lowest that fits"),
                io.Float.Input("memory_budget", default=1.0, min=0.0, max=1.0, step=0.05, optional=True,
                               tooltip="With compile: the share of each block's activations kept for the backward "
                               "pass; torch.compile recomputes the rest, cheapest ops first (1: keep all). An "
                               "alternative to checkpointing whole blocks"),
                io.Boolean.Input("selective", default=False, optional=True, tooltip="With activation "
                                 "checkpointing: keep the attention and MLP down-projection outputs, recompute the "
                                 "rest (Flux-dev 1024² compiled on an H200: 2.15 samples/s at 29.5 GiB, against "
                                 "1.93 at 26.5 GiB recomputing whole blocks). Needs compile to pay: uncompiled, "
                                 "and on SDXL, its per-operation policy made steps slower (SDXL: 4.5 against 9.1 "
                                 "samples/s). Not with offload_activations"),
            ],
            outputs=[t.Memory.Output(display_name="memory")],
        )

    @classmethod
    def validate_inputs(cls, offload_activations=None, selective=None):
        try:
            checkpointing_mode(MemorySpec(offload_activations=bool(offload_activations), selective=bool(selective)))
        except PipeTrainError as e:
            return str(e)
        return True

    @classmethod
    def execute(cls, activation_checkpointing, blocks_to_swap, offload_activations=False,
                compile=False, checkpoint_fraction=1.0, memory_budget=1.0, selective=False) -> io.NodeOutput:  # noqa: A002
        return io.NodeOutput(MemorySpec(activation_checkpointing, blocks_to_swap, offload_activations, compile,
                                        checkpoint_fraction, memory_budget, selective))
