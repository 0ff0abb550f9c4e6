# SPDX-License-Identifier: GPL-3.0-or-later
"""SD 1.x (eps) and SD 2.x (768-v: ComfyUI samples the tiny file with v-prediction) end to end on the CPU:
generated dataset -> cache -> 2 epochs with 2 DeepSpeed ranks as a 2-stage pipeline (skip connections cross the
cut) -> epoch LoRAs loaded by ComfyUI's LoraLoaderModelOnly, reproducing the training-side output."""
import pytest
from conftest import check_epoch_loras, train

pytestmark = pytest.mark.slow

# every linear of the 16 SpatialTransformers: attention 8 + feed-forward 2, SD 2.x's linear proj_in / proj_out 2
LORA_KEYS = {"sd15": 16 * 10, "sd2": 16 * 12}


@pytest.mark.parametrize("arch", sorted(LORA_KEYS))
def test_sd_two_stage_pipeline_to_comfyui_lora(model_files, make_run, arch):
    # 4 pictures (both bucket shapes), 4 steps an epoch: each epoch's LoRA is checked, and what is asserted of it (it
    # loads, reproduces the training side, moves the output) does not grow with the number of steps
    config = make_run(model_files(arch), images=4, stages=2, epochs=2, model={"type": arch})
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    assert run.status()["state"] == "finished"
    assert [e["epoch"] for e in run.events("lora_saved")] == [1, 2]
    check_epoch_loras(run, config, LORA_KEYS[arch])
