"""HunyuanVideo t2v end to end on the CPU: generated clips (mp4, webm, gif, animated WebP) and still images ->
cache (ComfyUI's causal 3D VAE on 5-D video, LLaVA-Llama-3 + CLIP-L) -> 2 epochs with 2 DeepSpeed ranks as a
2-stage pipeline -> epoch LoRAs loaded by ComfyUI's LoraLoaderModelOnly, reproducing the training-side output."""
import pytest
from conftest import cached_latents, check_epoch_loras, train, train_on_clips
from media import make_video_dataset

from pipetrain.backend.commands.demo import write_configs

pytestmark = pytest.mark.slow


def test_hunyuan_video_two_stage_pipeline_on_video_to_comfyui_lora(model_files, tmp_path):
    run, config = train_on_clips(model_files("hunyuan_video"), tmp_path / "job", "hunyuan_video", epochs=2)
    cached = cached_latents(tmp_path / "job", "hunyuan_video")
    assert {name: bucket for name, (bucket, _) in cached.items()} == {   # clips resampled to 24 fps, frame buckets
        "clip_mp4.mp4": (64, 64, 17), "clip_webm.webm": (64, 64, 17), "clip_gif.gif": (64, 64, 9),
        "clip_webp.webp": (64, 64, 17), "still0.png": (64, 64), "still1.png": (64, 64)}
    assert cached["clip_mp4.mp4"][1] == (16, 5, 8, 8) and cached["clip_gif.gif"][1] == (16, 3, 8, 8)
    assert cached["still0.png"][1] == (16, 1, 8, 8)                         # an image is a one-frame clip
    engine = run.events("engine")[0]   # input + 2 double | join + 2 single + output
    assert engine["stage_bounds"] == [0, 3, 7] and engine["steps_per_epoch"] == 6
    assert [e["epoch"] for e in run.events("lora_saved")] == [1, 2]
    check_epoch_loras(run, config, keys=26)   # 10 linears in each of 2 double blocks, 3 in each of 2 single


def test_hunyuan_video_15_padded_captions_and_glyphs_through_the_pipeline(model_files, tmp_path):
    """HunyuanVideo 1.5 (double blocks only, 16x VAE, Qwen2.5-VL + byT5) with 2 samples a micro-batch whose
    captions differ in length and in quoted text (glyph tokens for one, none for the other): the padding
    masks cross the stage boundary."""
    root = tmp_path / "job"
    dataset = make_video_dataset(root / "dataset")
    (dataset / "clip_mp4.txt").write_text('a square moving right past a sign reading "GO"')
    (dataset / "still0.txt").write_text('a square on a poster that says "HELLO WORLD"')
    config = write_configs(root, model_files("hunyuan_video_15"), stages=2, epochs=2, micro_batch_size_per_gpu=2,
                           model={"type": "hunyuan_video_15"})
    with open(root / "dataset.toml", "a") as f:
        f.write("frame_buckets = [1, 9, 17]\n")
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    assert run.status()["state"] == "finished"
    latents = cached_latents(root, "hunyuan_video_15")
    assert latents["clip_mp4.mp4"][1] == (32, 5, 4, 4) and latents["still0.png"][1] == (32, 1, 4, 4)
    engine = run.events("engine")[0]   # input + 2 double | join + output; a pair of 17-frame clips, the 2 stills
    assert engine["stage_bounds"] == [0, 2, 5] and engine["steps_per_epoch"] == 2
    # 10 + 7: the last block's text projection and MLP reach nothing
    check_epoch_loras(run, config, keys=17, last_only=True)


def test_hunyuan_image_21_two_stage_pipeline_to_comfyui_lora(model_files, make_run):
    """HunyuanImage 2.1 on images (2-D latents of its 32x VAE), 2 captions a micro-batch, one quoting text."""
    config = make_run(model_files("hunyuan_image_21"), images=4, stages=2, epochs=2, micro_batch_size_per_gpu=2,
                      model={"type": "hunyuan_image_21"}, optimizer={"lr": 1e-2})   # 4 steps in all
    (config.parent / "dataset" / "img00.txt").write_text('a red circle above the word "RED"')
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    assert run.status()["state"] == "finished"
    engine = run.events("engine")[0]   # input + 2 double | join + 2 single + output; 2 buckets of 2 images
    assert engine["stage_bounds"] == [0, 3, 7] and engine["steps_per_epoch"] == 2
    check_epoch_loras(run, config, keys=26, last_only=True)
