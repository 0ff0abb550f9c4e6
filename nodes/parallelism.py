# SPDX-License-Identifier: GPL-3.0-or-later
"""Parallelism: GPUs, pipeline stages, micro batches and the cluster a run spans (split from settings.py)."""
from __future__ import annotations

from pathlib import Path

from comfy_api.latest import io

from ..backend.config.patch import RunPatch
from ..backend.errors import PipeTrainError
from ..launcher.cluster_form import FLAGS, LAUNCHERS, OFF, check_cluster, cluster_form
from ..launcher.forms import unset_if_zero
from ..launcher.specs import ParallelismSpec
from . import types as t
from .declared import CheckedNode
from .widgets import choices, start, words


def parse_gpu_ids(text: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(w) for w in words(text))
    except ValueError:
        raise ValueError(f"gpu_ids {text!r}: write GPU indices separated by commas, e.g. 0,1") from None
    if len(set(ids)) != len(ids) or any(not 0 <= i < 1024 for i in ids):
        raise ValueError(f"gpu_ids {text!r}: each GPU index once, 0 to 1023")
    return ids


def parse_split(text: str | None) -> tuple[int, ...] | None:
    """``12`` or ``8, 16``: the layer indices where the stages after the first start (empty: None)."""
    try:
        split = tuple(int(w) for w in words(text or ""))
    except ValueError:
        raise ValueError(f"partition_split {text!r}: write layer indices separated by commas, e.g. 8, 16") from None
    return split or None


def hostfile_path(text: str | None) -> str:
    """A hostfile as typed: an absolute path, or a path under ComfyUI's input directory ('' stays '')."""
    text = (text or "").strip()
    if not text:
        return ""
    import folder_paths
    p = Path(text).expanduser()
    return str(p if p.is_absolute() else (Path(folder_paths.get_input_directory()) / p).resolve())


class ParallelismNode(CheckedNode):
    # the widgets shown; the rest folded as advanced
    SHOWN = ("gpus", "pipeline_stages", "micro_batch_size_per_gpu", "gradient_accumulation_steps", "gpu_ids")

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="PipeTrainParallelism", display_name="PipeTrain Parallelism", category=t.CATEGORY,
            inputs=[
                io.Int.Input("gpus", default=0, min=0, max=64, tooltip="Number of GPUs (DeepSpeed ranks) for the run "
                             "on this machine. 0: every GPU it has (one CPU rank where it has none); with a cluster "
                             "the hosts' slots decide instead"),
                io.Int.Input("pipeline_stages", default=0, min=0, max=64,
                             tooltip="Split the model over this many "
                             "GPUs; must divide gpus, or a cluster's total slots (the rest is data parallel). 0: the "
                             "memory planner chooses the fewest stages the model fits in"),
                io.Int.Input("micro_batch_size_per_gpu", default=start("micro_batch_size_per_gpu"), min=1, max=256,
                             tooltip="Images per micro batch"),
                io.Int.Input("gradient_accumulation_steps", default=start("gradient_accumulation_steps"), min=1,
                             max=1024, tooltip="Micro batches per "
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
                                "variables for every node, KEY=VALUE a line (e.g. NCCL_DEBUG=INFO): NCCL_, GLOO_, "
                                    "UCX_, FI_, "
                                "OMP_, MKL_, CUDA_, TORCH_ switches; paths and code loaders are refused (docs/"
                                    "security.md)"),
                io.String.Input("nccl_socket_ifname", default="", optional=True, tooltip="Cluster: "
                                "NCCL_SOCKET_IFNAME, the network interface NCCL uses, e.g. eth0 (empty: NCCL picks)"),
                io.Combo.Input("nccl_ib_disable", options=list(FLAGS), default="default", optional=True,
                               tooltip="Cluster: NCCL_IB_DISABLE; true turns InfiniBand off (default: not set)"),
                io.Combo.Input("nccl_p2p_disable", options=list(FLAGS), default="default", optional=True,
                               tooltip="Cluster: NCCL_P2P_DISABLE; true turns GPU peer-to-peer off (default: not set)"),
                io.Combo.Input("partition_method", options=choices("partition_method"),
                               default=start("partition_method"), optional=True, tooltip="How the layers are split "
                               "over the pipeline stages: compute (measured cost), parameters, uniform, or manual "
                               "(partition_split)"),
                io.String.Input("partition_split", default="", optional=True, tooltip="partition_method manual: the "
                                "layer index each stage after the first starts at, e.g. 12 for 2 stages"),
                io.Int.Input("image_micro_batch_size_per_gpu", default=start("image_micro_batch_size_per_gpu"), min=0,
                             max=256, optional=True, tooltip="Video models: images per micro batch, e.g. 4 where one "
                             "clip fills the GPU (0: micro_batch_size_per_gpu)"),
                *batch_list_inputs(),
            ],
            outputs=[t.Parallelism.Output(display_name="parallelism")],
        )

    @classmethod
    def validate_inputs(cls, gpus=None, pipeline_stages=None, gpu_ids=None, cluster=None, hostfile=None, hosts=None,
                        master_addr=None, master_port=None, env=None, nccl_socket_ifname=None, partition_split=None):
        stages = pipeline_stages
        try:
            parse_split(partition_split)
            ids = parse_gpu_ids(gpu_ids or "")
        except ValueError as e:
            return str(e)
        if cluster not in (None, OFF):
            if ids:
                return f"gpu_ids {gpu_ids!r} apply to one machine; on a cluster each host uses its first <slots> GPUs"
            try:  # the hosts (hostfile read now), the backend's [cluster] rules, stages vs. total slots
                spec = cluster_form(cluster, hostfile=hostfile_path(hostfile), hosts=hosts or "",
                                    master_addr=master_addr or "", env=env or "",
                                    nccl_socket_ifname=nccl_socket_ifname or "",
                                    master_port=29500 if master_port is None else master_port)
                if stages:
                    check_cluster(spec, stages)
            except (PipeTrainError, ValueError) as e:
                return str(e)
            return True
        if gpus and stages and gpus % stages:   # 0: decided when the run starts
            return (f"pipeline_stages={stages} does not divide gpus={gpus}; use a GPU count that is a multiple of "
                    f"{stages}")
        if ids and gpus and len(ids) != gpus:
            return f"gpu_ids lists {len(ids)} GPUs but gpus={gpus}"
        return True

    @classmethod
    def execute(cls, gpus, pipeline_stages, micro_batch_size_per_gpu, gradient_accumulation_steps, gpu_ids,
                cluster=OFF, hostfile="", hosts="", master_addr="", master_port=29500, env="", nccl_socket_ifname="",
                nccl_ib_disable="default", nccl_p2p_disable="default", partition_method=start("partition_method"),
                partition_split="", image_micro_batch_size_per_gpu=0, micro_batch_size_by_resolution="",
                image_micro_batch_size_by_resolution="") -> io.NodeOutput:
        spec = cluster_form(cluster, hostfile=hostfile_path(hostfile), hosts=hosts, master_addr=master_addr,
                            master_port=master_port, env=env, nccl_socket_ifname=nccl_socket_ifname,
                            nccl_ib_disable=nccl_ib_disable, nccl_p2p_disable=nccl_p2p_disable)
        run = RunPatch.of(dict(pipeline_stages=unset_if_zero(pipeline_stages), micro_batch_size_per_gpu=micro_batch_size_per_gpu,
                               gradient_accumulation_steps=gradient_accumulation_steps,
                               partition_method=partition_method, partition_split=parse_split(partition_split),
                               image_micro_batch_size_per_gpu=unset_if_zero(image_micro_batch_size_per_gpu),
                               micro_batch_size_by_resolution=parse_batches(micro_batch_size_by_resolution,
                                                                            "micro_batch_size_by_resolution"),
                               image_micro_batch_size_by_resolution=parse_batches(
                                   image_micro_batch_size_by_resolution, "image_micro_batch_size_by_resolution")))
        return io.NodeOutput(ParallelismSpec(gpus, parse_gpu_ids(gpu_ids), spec, run))


def batch_list_inputs(prefix: str = "") -> list:
    """The two per-resolution micro-batch widgets (``resolution:batch`` lists) of training (Parallelism) or, with
    ``prefix`` 'eval_', of eval (Schedule)."""
    eval_ = "eval " if prefix else ""
    fallback = "eval_micro_batch_size_per_gpu, or the training list" if prefix else \
        "micro_batch_size_per_gpu everywhere"
    return [io.String.Input(f"{prefix}micro_batch_size_by_resolution", default="", optional=True,
                            tooltip=f"A{'n' if prefix else ''} {eval_}micro batch per resolution, e.g. 512:4, 1024:1: "
                            f"each bucket takes the entry nearest its size (empty: {fallback})"),
            io.String.Input(f"{prefix}image_micro_batch_size_by_resolution", default="", optional=True,
                            tooltip=f"Video models: the same for {eval_}images (empty: the list above, or "
                            f"{prefix}image_micro_batch_size_per_gpu)")]


def parse_batches(text: str, name: str) -> tuple[tuple[int, int], ...] | None:
    """"512:4, 1024:1" -> ((512, 4), (1024, 1)); empty: None."""
    pairs = []
    for part in words(text):
        resolution, _, batch = part.partition(":")
        try:
            pairs.append((int(resolution), int(batch)))
        except ValueError:
            raise ValueError(f"{name} {text!r}: write resolution:batch pairs separated by commas, e.g. "
                             "512:4, 1024:1") from None
    return tuple(pairs) or None
