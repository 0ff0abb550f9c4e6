"""The whole path on the CPU with real DeepSpeed ranks: generated dataset -> cache -> 2 epochs with
2 ranks as a 2-stage pipeline -> 2 epoch LoRAs -> each loaded by ComfyUI's LoraLoaderModelOnly."""
import pytest
from conftest import train

from pipetrain.backend.config import load_run_config
from pipetrain.backend.parity.verify import check_loras

pytestmark = pytest.mark.slow

# ComfyUI merges the LoRA into the weights (W + s*B@A) and runs its own attention; the training side
# adds the low-rank product in the forward pass and uses SDPA. Both in float32: they agree to ~1e-5.
MATCH_TOLERANCE = 1e-4
MIN_EFFECT = 1e-3


def test_flux_two_stage_pipeline_to_comfyui_lora(tiny_flux_files, make_run):
    # 2 pictures (a square and a landscape one: both bucket shapes), 2 steps an epoch: the training steps at Flux's full
    # width are most of the test's time, and what is asserted (the stages, one LoRA an epoch, each reproduced by
    # ComfyUI and moving its output) does not grow with the number of steps
    config = make_run(tiny_flux_files, images=2, stages=2, epochs=2)
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-4000:]

    engine = run.events("engine")[0]
    assert engine["stage_bounds"] == [0, 3, 5]          # input+double+join | single+output
    assert engine["steps_per_epoch"] == 2               # 2 images, micro batch 1, 1 data-parallel rank
    assert run.events("cached")[0]["latents_encoded"] == 2
    assert run.status()["state"] == "finished"
    loras = run.loras()
    assert [e["epoch"] for e in run.events("lora_saved")] == [1, 2]
    assert len(set(loras)) == 2 and all(p.is_file() for p in loras)
    assert all(p.with_suffix("").with_suffix(".adapter.json").is_file() for p in loras)

    cfg = load_run_config(config)
    effects = []
    for check in check_loras(cfg, loras):
        assert check.keys_loaded == 13                  # every adapted linear of 1 double + 1 single block
        assert check.comfy_vs_training < MATCH_TOLERANCE * max(1.0, check.scale)
        assert check.lora_effect > MIN_EFFECT
        effects.append(check.lora_effect)
    assert effects[0] != effects[1]
