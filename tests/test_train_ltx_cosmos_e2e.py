"""LTX-Video and Cosmos end to end on the CPU: generated clips and still images (LTX-Video: 8k + 1 frame clips
resampled to 25 fps through LTX's causal video VAE) or images (Cosmos-Predict2: one-frame Wan 2.1 latents)
-> cache -> training with 2 DeepSpeed ranks as a 2-stage pipeline -> epoch LoRAs loaded by ComfyUI's
LoraLoaderModelOnly, reproducing the training-side output."""
import pytest
from conftest import train
from media import make_video_dataset

from pipetrain.backend.cache import CacheStore
from pipetrain.backend.cache.manifest import CacheManifest
from pipetrain.backend.config import load_run_config
from pipetrain.backend.demo import make_dataset, write_configs
from pipetrain.backend.verify import check_lora

pytestmark = pytest.mark.slow

MATCH_TOLERANCE = 1e-4   # float32 both sides
MIN_EFFECT = 1e-3


def _check_loras(run, config, keys):
    cfg = load_run_config(config)
    for path in run.loras():
        check = check_lora(cfg, path)
        assert check.keys_loaded == keys
        assert check.comfy_vs_training < MATCH_TOLERANCE * max(1.0, check.scale)
        assert check.lora_effect > MIN_EFFECT


def _manifest(root, arch):
    cache = root / "output" / "cache"
    entries = CacheManifest.load(next(cache.glob(f"manifests/{arch}-*"))).entries
    store = CacheStore(cache)
    return {e.path.rsplit("/", 1)[-1]: (e.bucket, store.get("latents", e.latent)["latent"].shape) for e in entries}


def test_ltx_video_two_stage_pipeline_on_video_to_comfyui_lora(model_files, tmp_path):
    root = tmp_path / "job"
    make_video_dataset(root / "dataset")
    config = write_configs(root, model_files("ltx_video"), stages=2, epochs=1, model={"type": "ltx_video"})
    with open(root / "dataset.toml", "a") as f:   # lands in the [[directory]] table: per-directory buckets
        f.write("frame_buckets = [1, 9, 17]\n")
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    assert run.status()["state"] == "finished"
    assert run.events("cached")[0]["latents_encoded"] == 6                 # 4 clips, 2 images
    cached = _manifest(root, "ltx_video")
    assert cached["clip_mp4.mp4"] == ((64, 64, 17), (128, 3, 2, 2))         # 17 frames -> 3 latent frames, 32x
    assert cached["clip_gif.gif"] == ((64, 64, 9), (128, 2, 2, 2))
    assert cached["still0.png"] == ((64, 64), (128, 1, 2, 2))              # an image is a one-frame clip
    engine = run.events("engine")[0]
    assert engine["stage_bounds"] == [0, 2, 4] and engine["steps_per_epoch"] == 6
    assert [e["epoch"] for e in run.events("lora_saved")] == [1]
    _check_loras(run, config, keys=20)   # q/k/v/out of self- and cross-attention + 2 FFN linears, 2 blocks


def test_cosmos_predict2_two_stage_pipeline_on_images_to_comfyui_lora(model_files, tmp_path):
    root = tmp_path / "job"
    make_dataset(root / "dataset", 4)
    config = write_configs(root, model_files("cosmos_predict2"), stages=2, epochs=1,
                           model={"type": "cosmos_predict2"})
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    assert run.status()["state"] == "finished"
    cached = _manifest(root, "cosmos_predict2")
    assert cached["img00.png"] == ((64, 64), (16, 1, 8, 8))                # an image is a one-frame Wan latent
    engine = run.events("engine")[0]
    assert engine["stage_bounds"] == [0, 2, 4] and engine["steps_per_epoch"] == 4
    _check_loras(run, config, keys=32)   # q/k/v/output of both attentions, 2 MLP, 3 x 2 adaLN linears, 2 blocks
