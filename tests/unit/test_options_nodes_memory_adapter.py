"""The Adapter, Optimizer and Memory nodes reach the run config: type lokr (+ decompose_factor), full (no [adapter]
table: a full fine-tune), AdamW8bitKahan, blocks_to_swap, compile; each checked as the Train node checks a graph."""
from __future__ import annotations

import pytest

from pipetrain.backend.config import RunConfig
from pipetrain.backend.config.schema import from_dict
from pipetrain.backend.config.patch import RunPatch
from pipetrain.launcher.build import run_table
from pipetrain.launcher.forms import adapter_patch, folder_patch, memory_patch, model_patch
from pipetrain.launcher.specs import LORA, DatasetSpec, TrainSpec

DATA = DatasetSpec((folder_patch("/data", resolutions=(64,)),), RunPatch.of({"resolutions": (64,)}))


def _config(adapter=LORA, optimizer=RunPatch(), memory=RunPatch()) -> RunConfig:
    spec = TrainSpec(DATA, model_patch("flux", "/m.safetensors", "/v.safetensors", ("/t.safetensors",)),
                     adapter=adapter, optimizer=optimizer, memory=memory)
    table = run_table(spec, output_dir="/out", dataset="/out/dataset.toml", run_name=None, lora_dir=None)
    return from_dict(RunConfig, table, file="nodes")


def test_adapter_types_optimizer_and_block_swap_reach_the_config():
    cfg = _config(adapter_patch(dict(rank=8, type="lokr", decompose_factor=4)),
                  RunPatch.of({"optimizer.type": "AdamW8bitKahan"}),
                  memory_patch(False, blocks_to_swap=3, compile=True))
    assert cfg.compile and not _config().compile
    assert (cfg.adapter.type, cfg.adapter.rank, cfg.adapter.decompose_factor) == ("lokr", 8, 4)
    assert cfg.optimizer.type == "AdamW8bitKahan" and cfg.blocks_to_swap == 3
    assert _config().adapter.type == "lora"
    full = _config(adapter_patch(dict(type="full")))
    assert full.adapter is None                           # no [adapter] table: a full fine-tune


def test_node_forms_build_those_specs():
    from pipetrain.backend.host.runtime import ensure_comfyui
    ensure_comfyui()
    from pipetrain.nodes.settings import AdapterNode, MemoryNode, OptimizerNode

    spec = AdapterNode.execute(8, 0.0, 0.0, "", type="lokr", decompose_factor=4).result[0]
    assert spec == RunPatch.of({"rank": 8, "type": "lokr", "decompose_factor": 4, "dropout": 0.0}, "adapter")
    assert AdapterNode.validate_inputs(type="lora", decompose_factor=4) != True   # noqa: E712
    assert MemoryNode.execute(True, 2).result[0].get("blocks_to_swap") == 2
    assert MemoryNode.execute(True, 0, compile=True).result[0].get("compile")
    half = MemoryNode.execute(True, 0, checkpoint_fraction=0.5).result[0]
    assert half.get("activation_checkpointing_fraction") == 0.5
    assert OptimizerNode.execute("AdamW8bitKahan", 1e-4, 0.9, 0.99, 0.0, 1e-8).result[0].get("optimizer.type") \
        == "AdamW8bitKahan"


def test_a_merged_lora_from_the_model_node_reaches_the_config():
    spec = TrainSpec(DATA, model_patch("z_image", "/m.safetensors", "/v.safetensors", ("/t.safetensors",),
                                       merge_adapters=("/loras/turbo_adapter.safetensors",)))
    table = run_table(spec, output_dir="/out", dataset="/out/dataset.toml", run_name=None, lora_dir=None)
    assert from_dict(RunConfig, table, file="nodes").model.merge_adapters == ["/loras/turbo_adapter.safetensors"]


def test_the_memory_nodes_checkpointing_switches_pick_the_mode():
    from pipetrain.backend.errors import ConfigError
    from pipetrain.backend.host.runtime import ensure_comfyui
    ensure_comfyui()
    from pipetrain.nodes.settings import MemoryNode

    modes = {(ckpt, offload, selective): _config(memory=MemoryNode.execute(
        ckpt, 0, offload_activations=offload, selective=selective).result[0]).activation_checkpointing
        for ckpt in (False, True) for offload in (False, True) for selective in (False, True)
        if not (offload and selective)}
    assert modes == {(False, False, False): False, (False, True, False): False, (False, False, True): False,
                     (True, False, False): True, (True, True, False): "unsloth", (True, False, True): "selective"}
    assert MemoryNode.validate_inputs(offload_activations=True, selective=True) != True   # noqa: E712
    assert MemoryNode.validate_inputs(offload_activations=True, selective=False) is True
    with pytest.raises(ConfigError, match="selective"):
        _config(memory=memory_patch(True, offload_activations=True, selective=True))
