"""LTX-Video and Cosmos end to end on the CPU: generated clips and still images (LTX-Video: 8k + 1 frame clips
resampled to 25 fps through LTX's causal video VAE) or images (Cosmos-Predict2: one-frame Wan 2.1 latents)
-> cache -> training with 2 DeepSpeed ranks as a 2-stage pipeline -> epoch LoRAs loaded by ComfyUI's
LoraLoaderModelOnly, reproducing the training-side output. LTX-Video image to video: the clips' first frames
cached as the given latent frame."""
import pytest
import torch
from conftest import cached_latents, check_epoch_loras, train, train_on_clips
from media import make_video_dataset

from pipetrain.backend.commands.demo import make_dataset, write_configs

pytestmark = pytest.mark.slow


def test_ltx_video_two_stage_pipeline_on_video_to_comfyui_lora(model_files, tmp_path):
    run, config = train_on_clips(model_files("ltx_video"), tmp_path / "job", "ltx_video")
    cached = cached_latents(tmp_path / "job", "ltx_video")
    assert cached["clip_mp4.mp4"] == ((64, 64, 17), (128, 3, 2, 2))         # 17 frames -> 3 latent frames, 32x
    assert cached["clip_gif.gif"] == ((64, 64, 9), (128, 2, 2, 2))
    assert cached["still0.png"] == ((64, 64), (128, 1, 2, 2))              # an image is a one-frame clip
    engine = run.events("engine")[0]
    assert engine["stage_bounds"] == [0, 2, 4] and engine["steps_per_epoch"] == 6
    assert [e["epoch"] for e in run.events("lora_saved")] == [1]
    check_epoch_loras(run, config, keys=20)   # q/k/v/out of self- and cross-attention + 2 FFN linears, 2 blocks


def test_ltx_video_i2v_first_frame_given(model_files, tmp_path):
    """ltx_video_i2v on the t2v model file: each clip's cached ``first_frame`` is its first frame's latent (LTX's
    causal VAE: the clip's first latent frame depends on its first pixel frame alone); the LoRA loads."""
    from pipetrain.backend.cache import CacheStore
    from pipetrain.backend.cache.manifest import CacheManifest

    root = tmp_path / "job"
    make_video_dataset(root / "dataset")
    for still in (root / "dataset").glob("still*"):
        still.unlink()   # i2v trains on clips only
    config = write_configs(root, model_files("ltx_video"), stages=2, epochs=1, model={"type": "ltx_video_i2v"})
    with open(root / "dataset.toml", "a") as f:
        f.write("frame_buckets = [9, 17]\n")
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    store = CacheStore(root / "output" / "cache")
    manifest = CacheManifest.load(next((root / "output" / "cache").glob("manifests/ltx_video_i2v-*")))
    assert len(manifest.entries) == 4
    for e in manifest.entries:
        payload = store.get("latents", e.latent)
        assert payload["first_frame"].shape == (128, 1, 2, 2) and payload["latent"].shape[1] in (2, 3)
        assert torch.allclose(payload["first_frame"], payload["latent"][:, :1], atol=1e-5)
    assert run.events("engine")[0]["stage_bounds"] == [0, 2, 4]
    check_epoch_loras(run, config, keys=20)


def test_cosmos_predict2_two_stage_pipeline_on_images_to_comfyui_lora(model_files, tmp_path):
    root = tmp_path / "job"
    make_dataset(root / "dataset", 4)
    config = write_configs(root, model_files("cosmos_predict2"), stages=2, epochs=1,
                           model={"type": "cosmos_predict2"})
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    assert run.status()["state"] == "finished"
    cached = cached_latents(root, "cosmos_predict2")
    assert cached["img00.png"] == ((64, 64), (16, 1, 8, 8))                # an image is a one-frame Wan latent
    engine = run.events("engine")[0]
    assert engine["stage_bounds"] == [0, 2, 4] and engine["steps_per_epoch"] == 4
    check_epoch_loras(run, config, keys=32)   # q/k/v/output of both attentions, 2 MLP, 3 x 2 adaLN linears, 2 blocks
