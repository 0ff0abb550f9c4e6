# SPDX-License-Identifier: GPL-3.0-or-later
"""ComfyUI V3 nodes: forms that validate their inputs and return run keys (``backend/config/patch.py``, each
widget starting at its key's config default) or, for what exists in the UI alone, specs (``launcher.specs``)."""
from comfy_api.latest import ComfyExtension, io

from .data import DatasetNode, ImagesToDatasetNode, ModelNode
from .runs import LoadEpochLoRANode, RunControlNode, RunStatusNode, StopNode
from .samples import EpochSamplesNode, SamplesNode
from .parallelism import ParallelismNode
from .settings import AdapterNode, MemoryNode, OptimizerNode, ScheduleNode
from .train import CacheNode, TrainNode

NODES: list[type[io.ComfyNode]] = [
    DatasetNode, ImagesToDatasetNode, ModelNode, AdapterNode, OptimizerNode, ScheduleNode, ParallelismNode, MemoryNode,
    SamplesNode, CacheNode, TrainNode, RunStatusNode, StopNode, RunControlNode, LoadEpochLoRANode,
    EpochSamplesNode,
]


class PipeTrainExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return NODES
