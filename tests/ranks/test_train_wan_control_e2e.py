"""Wan 2.1 VACE and Fun-Control end to end on the CPU: generated clips with control videos of their own (another
square, same frame count and rate) paired through control_path -> cache (ComfyUI's Wan VAE through its
WanVaceToVideo / WanFunControlToVideo nodes) -> 2 DeepSpeed ranks as a 2-stage pipeline -> epoch LoRAs loaded by
ComfyUI's LoraLoaderModelOnly, reproducing the training-side output."""
import pytest
import torch
from conftest import check_epoch_loras, train
from media import make_video_dataset, moving_square, write_video
from PIL import Image, ImageOps

from pipetrain.backend.cache import CacheStore
from pipetrain.backend.cache.manifest import CacheManifest
from pipetrain.backend.demo import write_configs

pytestmark = pytest.mark.slow

CLIPS = {"clip_mp4.mp4": (17, 16), "clip_webm.webm": (20, 24), "clip_gif.gif": (12, 20), "clip_webp.webp": (10, 10)}


def _with_controls(files, root, arch, stills: bool, **overrides):
    """The video dataset (its stills kept with grey control images, or left out), a grey square's control video
    per clip (a different grey each), frame buckets of 9; the run's config."""
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
    return config


def _payloads(root, arch):
    cache = root / "output" / "cache"
    manifest = CacheManifest.load(next(cache.glob(f"manifests/{arch}-*")))
    store = CacheStore(cache)
    return {e.path.rsplit("/", 1)[-1]: (e, store.get("latents", e.latent)) for e in manifest.entries}


def _trained(files, tmp_path, arch, stills, **overrides):
    """A finished 2-rank run on the controlled dataset and its cached samples by file name."""
    root = tmp_path / "job"
    config = _with_controls(files, root, arch, stills, **overrides)
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    return config, run, _payloads(root, arch)


def test_wan_vace_trains_on_control_videos(model_files, tmp_path):
    config, run, payloads = _trained(model_files("wan_vace"), tmp_path, "wan_vace", stills=True, samples={
        "prompts": ["a square"], "width": 64, "height": 64, "steps": 2})   # a still, without the control
    entry, payload = payloads["clip_mp4.mp4"]
    assert entry.control.endswith("controls/clip_mp4.mp4") and entry.bucket == (64, 64, 9)
    vace = payload["vace_context"]
    assert vace.shape == (96, 3, 8, 8) and (vace[32:] == 1).all()   # no mask: all ones
    assert payloads["still0.png"][1]["vace_context"].shape == (96, 1, 8, 8)   # a still with its control image
    assert run.events("engine")[0]["stage_bounds"] == [0, 2, 4]
    check_epoch_loras(run, config, keys=20)   # the main blocks' linears; the VACE block keeps its weights
    assert [e["prompt"] for e in run.events("sample_saved")] == ["a square"]


def test_wan_fun_control_trains_on_control_videos(model_files, tmp_path):
    config, run, payloads = _trained(model_files("wan_fun_control"), tmp_path, "wan_fun_control", stills=False)
    concat = payloads["clip_mp4.mp4"][1]["concat"]
    assert concat.shape == (32, 3, 8, 8) and (concat[16:, 1:] == 0).all() and concat[16:, 0].abs().sum() > 0
    assert not torch.allclose(concat[:16], payloads["clip_gif.gif"][1]["concat"][:16])
    check_epoch_loras(run, config, keys=24)   # + cross_attn.k_img / v_img
