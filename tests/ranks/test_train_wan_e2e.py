"""Wan 2.1 t2v end to end on the CPU: generated 9-17 frame clips (mp4, webm, gif, animated WebP) and still
images -> cache (ComfyUI's Wan VAE on 5-D video, UMT5-XXL) -> 2 epochs with 2 DeepSpeed ranks as a 2-stage
pipeline -> epoch LoRAs loaded by ComfyUI's LoraLoaderModelOnly, reproducing the training-side output."""
import pytest
from conftest import cached_latents, check_epoch_loras, train_on_clips

pytestmark = pytest.mark.slow


def test_wan_two_stage_pipeline_on_video_to_comfyui_lora(model_files, tmp_path):
    run, config = train_on_clips(model_files("wan"), tmp_path / "job", "wan", epochs=2)
    cached = cached_latents(tmp_path / "job", "wan")
    assert {name: bucket for name, (bucket, _) in cached.items()} == {   # clips resampled to 16 fps, frame buckets
        "clip_mp4.mp4": (64, 64, 17), "clip_webm.webm": (64, 64, 9), "clip_gif.gif": (64, 64, 9),
        "clip_webp.webp": (64, 64, 9), "still0.png": (64, 64), "still1.png": (64, 64)}
    assert cached["clip_mp4.mp4"][1] == (16, 5, 8, 8) and cached["clip_gif.gif"][1] == (16, 3, 8, 8)
    assert cached["still0.png"][1] == (16, 1, 8, 8)                         # an image is a one-frame clip
    engine = run.events("engine")[0]
    assert engine["stage_bounds"] == [0, 2, 4] and engine["steps_per_epoch"] == 6
    assert [e["epoch"] for e in run.events("lora_saved")] == [1, 2]
    check_epoch_loras(run, config, keys=20)   # q/k/v/o of self- and cross-attention + 2 FFN linears, 2 blocks
