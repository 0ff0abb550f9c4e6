"""Chroma end to end on the CPU: generated dataset -> cache (T5-XXL, 16-channel VAE) -> 2 epochs with 2
DeepSpeed ranks as a 2-stage pipeline -> epoch LoRAs loaded by ComfyUI's LoraLoaderModelOnly, reproducing
the training-side output."""
import pytest
from conftest import train

from pipetrain.backend.config import load_run_config
from pipetrain.backend.parity.verify import check_loras

pytestmark = pytest.mark.slow

MATCH_TOLERANCE = 1e-4   # float32 both sides
MIN_EFFECT = 1e-3


def test_chroma_two_stage_pipeline_to_comfyui_lora(model_files, make_run):
    # 4 pictures: a micro-batch of 2 in each bucket shape, 2 steps an epoch (what is asserted of each epoch's LoRA
    # does not grow with the number of steps)
    config = make_run(model_files("chroma"), images=4, stages=2, epochs=2, model={"type": "chroma"},
                      micro_batch_size_per_gpu=2)   # two captions of different lengths per micro-batch
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    assert run.status()["state"] == "finished"
    assert run.events("engine")[0]["stage_bounds"] == [0, 4, 7]     # input + 2 double + join | 2 single + output
    assert [e["epoch"] for e in run.events("lora_saved")] == [1, 2]
    cfg = load_run_config(config)
    for check in check_loras(cfg, run.loras()):
        assert check.keys_loaded == 20           # 8 linears in each double block, 2 in each single block
        assert check.comfy_vs_training < MATCH_TOLERANCE * max(1.0, check.scale)
        assert check.lora_effect > MIN_EFFECT
