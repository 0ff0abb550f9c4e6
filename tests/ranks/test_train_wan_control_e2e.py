"""Wan 2.1 VACE and Fun-Control end to end on the CPU: generated clips with control videos of their own (another
square, same frame count and rate) paired through control_path (VACE: with mask videos and a reference image too)
-> cache (ComfyUI's Wan VAE through its WanVaceToVideo / WanFunControlToVideo nodes) -> 2 DeepSpeed ranks as a
2-stage pipeline -> epoch LoRAs loaded by ComfyUI's LoraLoaderModelOnly, reproducing the training-side output."""
import numpy as np
import pytest
import torch
from conftest import check_epoch_loras, train
from media import make_video_dataset, moving_square, write_video
from PIL import Image, ImageOps

from pipetrain.backend.cache import CacheStore
from pipetrain.backend.cache.manifest import CacheManifest
from pipetrain.backend.commands.demo import write_configs

pytestmark = pytest.mark.slow

CLIPS = {"clip_mp4.mp4": (17, 16), "clip_webm.webm": (20, 24), "clip_gif.gif": (12, 20), "clip_webp.webp": (10, 10)}


def _with_controls(files, root, arch, stills: bool, vace_inputs: bool = False, **overrides):
    """The video dataset (its stills kept with grey control images, or left out), a grey square's control video
    per clip (a different grey each), frame buckets of 9; with ``vace_inputs`` a mask video per clip (the square
    white on black; stills: a mask image) in ``masks/`` and one reference image for all; the run's config."""
    dataset, controls = root / "dataset", root / "controls"
    make_video_dataset(dataset)
    controls.mkdir()
    for i, (name, (count, fps)) in enumerate(CLIPS.items()):
        write_video(controls / name, moving_square(count, rgb=(60 + 40 * i,) * 3), fps)
    for still in dataset.glob("still*.png"):
        if stills:
            ImageOps.grayscale(Image.open(still)).convert("RGB").save(controls / still.name)
        else:
            still.unlink()
            still.with_suffix(".txt").unlink()
    config = write_configs(root, files, stages=2, epochs=1, model={"type": arch}, **overrides)
    with open(root / "dataset.toml", "a") as f:   # lands in the [[directory]] table
        f.write(f'frame_buckets = [1, 9]\ncontrol_path = "{controls}"\n')
        if vace_inputs:
            f.write(f'control_mask_path = "{_masks(root, dataset)}"\nreference_path = "{root / "reference.png"}"\n')
    return config


def _masks(root, dataset):
    """Per clip a mask video (the moving square white, the rest black), per still a mask image (its left half);
    and ``reference.png``, a red square on grey."""
    masks = root / "masks"
    masks.mkdir()
    for name, (count, fps) in CLIPS.items():
        write_video(masks / name, [np.where(f == 240, 0, 255).astype(np.uint8)
                                   for f in moving_square(count, rgb=(255,) * 3)], fps)
    for still in dataset.glob("still*.png"):
        half = np.zeros((64, 64, 3), dtype=np.uint8)
        half[:, :32] = 255
        Image.fromarray(half).resize(Image.open(still).size).save(masks / still.name)
    Image.fromarray(moving_square(1)[0]).save(root / "reference.png")
    return masks


def _payloads(root, arch):
    cache = root / "output" / "cache"
    manifest = CacheManifest.load(next(cache.glob(f"manifests/{arch}-*")))
    store = CacheStore(cache)
    return {e.path.rsplit("/", 1)[-1]: (e, store.get("latents", e.latent)) for e in manifest.entries}


def _trained(files, tmp_path, arch, stills, vace_inputs=False, **overrides):
    """A finished 2-rank run on the controlled dataset and its cached samples by file name."""
    root = tmp_path / "job"
    config = _with_controls(files, root, arch, stills, vace_inputs, **overrides)
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    return config, run, _payloads(root, arch)


def test_wan_vace_trains_on_control_videos_masks_and_a_reference(model_files, tmp_path):
    config, run, payloads = _trained(model_files("wan_vace"), tmp_path, "wan_vace", stills=True, vace_inputs=True,
                                     samples={"prompts": ["a square"], "width": 64, "height": 64, "steps": 2})
    entry, payload = payloads["clip_mp4.mp4"]
    assert entry.control.endswith("controls/clip_mp4.mp4") and entry.bucket == (64, 64, 9)
    assert entry.control_mask.endswith("masks/clip_mp4.mp4") and entry.reference.endswith("reference.png")
    vace = payload["vace_context"]
    # the reference's latent frame in front (its mask zero), then the clip's 3 frames under the square's mask
    assert vace.shape == (96, 4, 8, 8) and payload["latent"].shape == (16, 3, 8, 8)
    assert (vace[32:, 0] == 0).all() and vace[:16, 0].abs().sum() > 0
    mask = vace[32:, 1:]
    assert (mask == 0).any() and (mask == 1).any()
    still = payloads["still0.png"][1]["vace_context"]   # a still with its control and mask images
    assert still.shape == (96, 2, 8, 8) and (still[32:, 1] == 1).any() and (still[32:, 1] == 0).any()
    assert run.events("engine")[0]["stage_bounds"] == [0, 2, 4]
    check_epoch_loras(run, config, keys=20)   # the main blocks' linears; the VACE block keeps its weights
    assert [e["prompt"] for e in run.events("sample_saved")] == ["a square"]


def test_wan_fun_control_trains_on_control_videos(model_files, tmp_path):
    config, run, payloads = _trained(model_files("wan_fun_control"), tmp_path, "wan_fun_control", stills=False)
    concat = payloads["clip_mp4.mp4"][1]["concat"]
    assert concat.shape == (32, 3, 8, 8) and (concat[16:, 1:] == 0).all() and concat[16:, 0].abs().sum() > 0
    assert not torch.allclose(concat[:16], payloads["clip_gif.gif"][1]["concat"][:16])
    check_epoch_loras(run, config, keys=24)   # + cross_attn.k_img / v_img
