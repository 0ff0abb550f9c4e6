"""Qwen-Image and Qwen-Image-Edit end to end on the CPU: generated dataset (Edit: with a control_path folder of
paired control images) -> cache (Qwen-Image's Wan 2.1-class VAE on one-frame latents, Qwen2.5-VL-7B text,
Edit's reference latents; Edit-2509: two control folders) -> 2 DeepSpeed ranks as a 2-stage pipeline -> epoch LoRAs loaded by ComfyUI's
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
    # 2 pictures (a square and a landscape one: both bucket shapes): each caption is read with its control image by
    # the real-size vision tower, most of the test's time, so no more of them than the assertions need
    config = make_run(model_files("qwen_image_edit"), images=2, stages=2, epochs=2, model={"type": "qwen_image_edit"},
                      optimizer={"lr": 1e-2})      # 4 steps: enough for a visible LoRA at this rate
    root = add_control_images(config)
    run = train(config, ranks=2)
    _check(config, run, last_only=True)     # 2 steps an epoch: the first epoch may barely move
    assert [e["epoch"] for e in run.events("lora_saved")] == [1, 2]
    cache = root / "output" / "cache"
    store = CacheStore(cache)
    for entry in CacheManifest.load(next(cache.glob("manifests/qwen_image_edit-*"))).entries:
        payload = store.get("latents", entry.latent)
        assert payload["reference"].shape == payload["latent"].shape   # the control image at the same bucket
        assert store.get("text", entry.text)["context"].shape[0] > 100  # the caption was read with the image


def test_qwen_image_edit_plus_with_two_control_folders_to_comfyui_lora(model_files, make_run):
    """Qwen-Image-Edit-2509: two control folders (control_path as a list): two reference latents a picture, and
    each caption read with both images ("Picture 1", "Picture 2"; the vision tower's two passes a caption are most of
    the test's time: 2 pictures, a square and a landscape one)."""
    config = make_run(model_files("qwen_image_edit_plus"), images=2, stages=2, epochs=2,
                      model={"type": "qwen_image_edit_plus"},
                      optimizer={"lr": 1e-2})      # 4 steps: enough for a visible LoRA at this rate
    root = add_control_images(config, folders=2)
    run = train(config, ranks=2)
    _check(config, run, last_only=True)
    cache = root / "output" / "cache"
    store = CacheStore(cache)
    one_image = None
    for entry in CacheManifest.load(next(cache.glob("manifests/qwen_image_edit_plus-*"))).entries:
        payload = store.get("latents", entry.latent)
        assert payload["references"].shape == (2, *payload["latent"].shape)   # both at the picture's bucket
        assert len(entry.more_controls) == 1 and "controls2" in entry.more_controls[0]
        one_image = one_image or store.get("text", entry.text)["context"].shape[0]
    assert one_image > 200       # two images' vision tokens in the sequence (one image: > 100)
