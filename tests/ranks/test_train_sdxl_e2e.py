"""SDXL end to end on the CPU: generated dataset -> cache -> 2 epochs with 2 DeepSpeed ranks as a
2-stage pipeline (the cut falls inside the decoder, skip connections cross it) -> 2 epoch LoRAs loaded
by ComfyUI's LoraLoaderModelOnly, reproducing the training-side output."""
import pytest
from conftest import train

from pipetrain.backend.config import load_run_config
from pipetrain.backend.parity.verify import check_loras

pytestmark = pytest.mark.slow

MATCH_TOLERANCE = 1e-4   # float32 both sides; measured 1e-6
MIN_EFFECT = 1e-3        # measured 0.01-0.03 after 16 steps (8 now)


def test_sdxl_two_stage_pipeline_to_comfyui_lora(tiny_sdxl_files, make_run):
    # 4 pictures (both bucket shapes), 4 steps an epoch: what is asserted of each epoch's LoRA does not grow with the
    # number of steps
    config = make_run(tiny_sdxl_files, images=4, stages=2, epochs=2, model={"type": "sdxl"})
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    assert run.status()["state"] == "finished"
    assert [e["epoch"] for e in run.events("lora_saved")] == [1, 2]
    cfg = load_run_config(config)
    for check in check_loras(cfg, run.loras()):
        assert check.keys_loaded == 132           # 11 transformers x 12 linears
        assert check.comfy_vs_training < MATCH_TOLERANCE * max(1.0, check.scale)
        assert check.lora_effect > MIN_EFFECT
