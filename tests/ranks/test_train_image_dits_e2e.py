"""AuraFlow, HiDream and OmniGen2 end to end on the CPU: generated dataset -> cache (ComfyUI's text encoders
and VAE on tiny files) -> 1 epoch with 2 DeepSpeed ranks as a 2-stage pipeline -> the epoch LoRA loaded by ComfyUI's
LoraLoaderModelOnly, reproducing the training-side output."""
import pytest
from conftest import check_epoch_loras, train

pytestmark = pytest.mark.slow


# 4 pictures (both bucket shapes), 4 steps: what is asserted (finite losses, the LoRA reproduced by ComfyUI and moving
# its output, two stages) does not grow with the number of steps
def _train_and_check(make_run, model_files, model_type: str, keys: int, images: int = 4, lr: float = 2e-3):
    config = make_run(model_files(model_type), images=images, stages=2, epochs=1, model={"type": model_type},
                      optimizer={"lr": lr})
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    assert run.status()["state"] == "finished"
    assert [e["epoch"] for e in run.events("lora_saved")] == [1]
    losses = run.losses()
    assert losses and all(loss == loss for loss in losses)        # no NaN
    check_epoch_loras(run, config, keys=keys)
    bounds = run.events("engine")[0]["stage_bounds"]
    assert len(bounds) == 3 and 0 < bounds[1] < bounds[2]          # two non-empty stages
    return run


def test_auraflow_two_stage_pipeline_to_comfyui_lora(model_files, make_run):
    _train_and_check(make_run, model_files, "auraflow", keys=16 + 8,    # 1 double + 1 single layer
                     lr=3e-2)   # small random gates: a few steps at the usual rate barely move the output


def test_hidream_two_stage_pipeline_to_comfyui_lora(model_files, make_run):
    """Mixture-of-experts blocks trained through their gate; CLIP-L + CLIP-G + T5-XXL + Llama encoded at cache time."""
    _train_and_check(make_run, model_files, "hidream", keys=27 + 20, lr=3e-2)   # 1 double + 1 single block


def test_omnigen2_two_stage_pipeline_to_comfyui_lora(model_files, make_run):
    """Qwen2.5-3B captions, each as long as its own tokens; refiners and blocks on different stages."""
    run = _train_and_check(make_run, model_files, "omnigen2", keys=7 + 8 + 2 * 8, lr=3e-2)   # refiners + 2 blocks
    assert run.events("engine")[0]["stage_bounds"] == [0, 4, 7]   # input, refiners, join | 2 blocks, output
