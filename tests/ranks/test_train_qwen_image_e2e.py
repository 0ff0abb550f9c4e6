"""Qwen-Image and Qwen-Image-Edit end to end on the CPU: generated dataset (Edit: with a control_path folder of
paired control images) -> cache (Qwen-Image's Wan 2.1-class VAE on one-frame latents, Qwen2.5-VL-7B text,
Edit's reference latents) -> 2 DeepSpeed ranks as a 2-stage pipeline -> epoch LoRAs loaded by ComfyUI's
LoraLoaderModelOnly, reproducing the training-side output (Edit: with the reference latents as ComfyUI's
``ref_latents``)."""
import pytest
from conftest import add_control_images, check_epoch_loras, train

from pipetrain.backend.cache import CacheStore
from pipetrain.backend.cache.manifest import CacheManifest

pytestmark = pytest.mark.slow

LORA_KEYS = 14 + 10      # every linear of block 0; block 1 (the last) without its text queries and outputs


def _check(config, run, last_only=False):
    assert run.returncode == 0, run.output[-4000:]
    assert run.status()["state"] == "finished"
    assert run.events("engine")[0]["stage_bounds"] == [0, 2, 4]     # input + block 0 | block 1 + output
    check_epoch_loras(run, config, keys=LORA_KEYS, last_only=last_only)


def test_qwen_image_two_stage_pipeline_to_comfyui_lora(model_files, make_run):
    config = make_run(model_files("qwen_image"), images=6, stages=2, epochs=2, model={"type": "qwen_image"})
    run = train(config, ranks=2)
    _check(config, run, last_only=True)     # epoch 1 is 2 steps: its effect has measured just under MIN_EFFECT
    assert [e["epoch"] for e in run.events("lora_saved")] == [1, 2]
    cache = config.parent / "output" / "cache"
    entries = CacheManifest.load(next(cache.glob("manifests/qwen_image-*"))).entries
    latent = CacheStore(cache).get("latents", entries[0].latent)["latent"]
    assert latent.ndim == 4 and latent.shape[:2] == (16, 1)          # [C, 1 frame, h, w]


def test_qwen_image_edit_with_control_images_to_comfyui_lora(model_files, make_run):
    # 4 pictures: each caption is read with its control image by the real-size vision tower (~30 s on a CPU core)
    config = make_run(model_files("qwen_image_edit"), images=4, stages=2, epochs=2, model={"type": "qwen_image_edit"})
    root = add_control_images(config)
    run = train(config, ranks=2)
    _check(config, run, last_only=True)     # 4 steps an epoch: the first epoch may barely move
    assert [e["epoch"] for e in run.events("lora_saved")] == [1, 2]
    cache = root / "output" / "cache"
    store = CacheStore(cache)
    for entry in CacheManifest.load(next(cache.glob("manifests/qwen_image_edit-*"))).entries:
        payload = store.get("latents", entry.latent)
        assert payload["reference"].shape == payload["latent"].shape   # the control image at the same bucket
        assert store.get("text", entry.text)["context"].shape[0] > 100  # the caption was read with the image
