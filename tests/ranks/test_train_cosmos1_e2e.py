"""Cosmos 1.0 text-to-video end to end on the CPU: generated 9-20 frame clips (mp4, webm, gif, animated WebP)
resampled to 24 fps and still images -> cache (ComfyUI's CV8x8x8 tokenizer on 8k + 1 frame clips, the old
T5-XXL) -> training with 2 DeepSpeed ranks as a 2-stage pipeline -> the epoch LoRA loaded by ComfyUI's
LoraLoaderModelOnly, reproducing the training-side output."""
import pytest
from conftest import cached_latents, check_epoch_loras, train_on_clips

pytestmark = pytest.mark.slow


def test_cosmos1_two_stage_pipeline_on_video_to_comfyui_lora(model_files, tmp_path):
    run, config = train_on_clips(model_files("cosmos"), tmp_path / "job", "cosmos")
    latents = cached_latents(tmp_path / "job", "cosmos")
    assert latents["clip_mp4.mp4"] == ((64, 64, 17), (16, 3, 8, 8))       # 17 frames at 24 fps -> 3 latent frames
    assert latents["clip_gif.gif"] == ((64, 64, 9), (16, 2, 8, 8))
    assert latents["still0.png"] == ((64, 64), (16, 1, 8, 8))              # an image is a one-frame clip
    engine = run.events("engine")[0]
    assert engine["stage_bounds"] == [0, 2, 4] and engine["steps_per_epoch"] == 6
    assert [e["epoch"] for e in run.events("lora_saved")] == [1]
    check_epoch_loras(run, config, keys=32)   # per block: q/k/v/out of both attentions, 2 MLP, 3 x 2 adaLN linears
