"""Wan 2.1 t2v end to end on the CPU: generated 9-17 frame clips (mp4, webm, gif, animated WebP) and still
images -> cache (ComfyUI's Wan VAE on 5-D video, UMT5-XXL) -> 2 epochs with 2 DeepSpeed ranks as a 2-stage
pipeline -> epoch LoRAs loaded by ComfyUI's LoraLoaderModelOnly, reproducing the training-side output."""
import pytest
from conftest import train
from media import make_video_dataset

from pipetrain.backend.cache import CacheStore
from pipetrain.backend.cache.manifest import CacheManifest
from pipetrain.backend.config import load_run_config
from pipetrain.backend.demo import write_configs
from pipetrain.backend.verify import check_lora

pytestmark = pytest.mark.slow

MATCH_TOLERANCE = 1e-4   # float32 both sides
MIN_EFFECT = 1e-3


def test_wan_two_stage_pipeline_on_video_to_comfyui_lora(model_files, tmp_path):
    root = tmp_path / "job"
    make_video_dataset(root / "dataset")
    config = write_configs(root, model_files("wan"), stages=2, epochs=2, model={"type": "wan"})
    with open(root / "dataset.toml", "a") as f:   # lands in the [[directory]] table: per-directory buckets
        f.write("frame_buckets = [1, 9, 17]\n")
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    assert run.status()["state"] == "finished"
    assert run.events("cached")[0]["latents_encoded"] == 6                 # 4 clips, 2 images
    cache = root / "output" / "cache"
    entries = {e.path.rsplit("/", 1)[-1]: e for e in CacheManifest.load(next(cache.glob("manifests/wan-*"))).entries}
    assert {name: e.bucket for name, e in entries.items()} == {   # clips resampled to 16 fps, frame buckets
        "clip_mp4.mp4": (64, 64, 17), "clip_webm.webm": (64, 64, 9), "clip_gif.gif": (64, 64, 9),
        "clip_webp.webp": (64, 64, 9), "still0.png": (64, 64), "still1.png": (64, 64)}
    latents = {name: CacheStore(cache).get("latents", e.latent)["latent"].shape for name, e in entries.items()}
    assert latents["clip_mp4.mp4"] == (16, 5, 8, 8) and latents["clip_gif.gif"] == (16, 3, 8, 8)
    assert latents["still0.png"] == (16, 1, 8, 8)                           # an image is a one-frame clip
    engine = run.events("engine")[0]
    assert engine["stage_bounds"] == [0, 2, 4] and engine["steps_per_epoch"] == 6
    assert [e["epoch"] for e in run.events("lora_saved")] == [1, 2]
    cfg = load_run_config(config)
    for path in run.loras():
        check = check_lora(cfg, path)
        assert check.keys_loaded == 20           # q/k/v/o of self- and cross-attention + 2 FFN linears, 2 blocks
        assert check.comfy_vs_training < MATCH_TOLERANCE * max(1.0, check.scale)
        assert check.lora_effect > MIN_EFFECT
