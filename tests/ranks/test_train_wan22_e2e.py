"""Wan 2.2 TI2V 5B (t2v) and Wan 14B image-to-video end to end on the CPU: generated 9-17 frame clips -> cache
(ComfyUI's Wan 2.2 VAE at 24 fps / Wan 2.1 VAE with the first-frame conditioning) -> 2 DeepSpeed ranks as a
2-stage pipeline -> epoch LoRAs loaded by ComfyUI's LoraLoaderModelOnly, reproducing the training-side output."""
import pytest
import torch
from conftest import check_epoch_loras, train
from media import make_video_dataset

from pipetrain.backend.cache import CacheStore
from pipetrain.backend.cache.manifest import CacheManifest
from pipetrain.backend.config import load_run_config
from pipetrain.backend.commands.demo import write_configs

pytestmark = pytest.mark.slow

def _entries(root, arch):
    cache = root / "output" / "cache"
    manifest = CacheManifest.load(next(cache.glob(f"manifests/{arch}-*")))
    return CacheStore(cache), {e.path.rsplit("/", 1)[-1]: e for e in manifest.entries}



def test_wan22_5b_two_stage_pipeline_on_video_to_comfyui_lora(model_files, tmp_path):
    root = tmp_path / "job"
    make_video_dataset(root / "dataset")
    config = write_configs(root, model_files("wan22_5b"), stages=2, epochs=1, model={"type": "wan22_5b"})
    with open(root / "dataset.toml", "a") as f:
        f.write("frame_buckets = [1, 9, 17]\n")
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    assert run.status()["state"] == "finished"
    store, entries = _entries(root, "wan22_5b")
    # resampled to 24 fps: the 17-frame 16 fps clip has 25 frames, the 10-frame 10 fps one 24 -> both 17
    assert entries["clip_mp4.mp4"].bucket == (64, 64, 17) and entries["clip_webp.webp"].bucket == (64, 64, 17)
    latents = {name: store.get("latents", e.latent)["latent"].shape for name, e in entries.items()}
    assert latents["clip_mp4.mp4"] == (48, 5, 4, 4) and latents["still0.png"] == (48, 1, 4, 4)   # 16x spatial
    assert run.events("engine")[0]["stage_bounds"] == [0, 2, 4]
    check_epoch_loras(run, config, keys=20)


def test_wan_i2v_first_frame_conditions_the_clip(model_files, tmp_path):
    """Wan 2.1 i2v (tiny, with a tiny CLIP vision) as the high-noise expert's range (min_t = 0.9): the cached
    conditioning is the mask + the latent of the first frame and its CLIP-vision tokens; swapping them for
    another clip's changes the loss."""
    from pipetrain.backend.models.tiny import write_clip_vision
    from pipetrain.backend.models.wan import WanI2VAdapter

    root = tmp_path / "job"
    make_video_dataset(root / "dataset")
    for still in (root / "dataset").glob("still*"):
        still.unlink()   # i2v trains on clips only
    write_clip_vision(tmp_path / "clip_vision.safetensors")
    config = write_configs(root, model_files("wan_i2v"), stages=2, epochs=1, model={
        "type": "wan_i2v", "min_t": 0.9, "clip_vision": str(tmp_path / "clip_vision.safetensors")})
    with open(root / "dataset.toml", "a") as f:
        f.write("frame_buckets = [9]\n")
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    store, entries = _entries(root, "wan_i2v")
    payloads = {name: store.get("latents", e.latent) for name, e in entries.items()}
    concat, clip_fea = payloads["clip_mp4.mp4"]["concat"], payloads["clip_mp4.mp4"]["clip_fea"]
    assert concat.shape == (20, 3, 8, 8) and (concat[:4, 0] == 1).all() and (concat[:4, 1:] == 0).all()
    assert clip_fea.shape == (257, 1280)
    check_epoch_loras(run, config, keys=24)   # + cross_attn.k_img / v_img of Wan 2.1 i2v
    cfg = load_run_config(config)

    adapter = WanI2VAdapter(cfg.model, cfg.resolve)
    adapter.load_diffusion_model()
    layers = adapter.to_layers()
    g = torch.Generator().manual_seed(0)
    latent = payloads["clip_mp4.mp4"]["latent"][None]
    noise, t = torch.randn(latent.shape, generator=g), torch.tensor([0.95])
    context = store.get("text", entries["clip_mp4.mp4"].text)["context"][None]

    def loss(*cond):
        h = (latent, noise, t, context, *(c[None] for c in cond))
        with torch.no_grad():
            for layer in layers:
                h = layer(h)
        return adapter.loss(h, (latent, noise, t)).item()

    other = payloads["clip_gif.gif"]
    base = loss(concat, clip_fea)
    assert abs(loss(other["concat"], clip_fea) - base) > 1e-6 * base
    assert abs(loss(concat, other["clip_fea"]) - base) > 1e-6 * base


def test_wan22_5b_ti2v_first_frame_given(model_files, tmp_path):
    """The 5B's ti2v mode: the cached ``first_frame`` is the clip's first latent frame (the Wan 2.2 VAE encodes
    it from the first pixel frame alone), given to the model at timestep 0 and left out of the loss."""
    root = tmp_path / "job"
    make_video_dataset(root / "dataset")
    for still in (root / "dataset").glob("still*"):
        still.unlink()
    config = write_configs(root, model_files("wan22_5b"), stages=2, epochs=1, model={"type": "wan22_5b_i2v"})
    with open(root / "dataset.toml", "a") as f:
        f.write("frame_buckets = [9]\n")
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    store, entries = _entries(root, "wan22_5b_i2v")
    for e in entries.values():
        payload = store.get("latents", e.latent)
        assert payload["first_frame"].shape == (48, 1, 4, 4)
        assert torch.allclose(payload["first_frame"], payload["latent"][:, :1], atol=1e-6)
    check_epoch_loras(run, config, keys=20)


def test_wan_flf2v_first_and_last_frames_condition_the_clip(model_files, tmp_path):
    """Wan 2.1 first-last-frame (tiny, with a tiny CLIP vision): the cached conditioning is ComfyUI's mask for
    both given frames + their latent, and the two frames' CLIP-vision tokens (first, then last); the LoRA loads."""
    from pipetrain.backend.models.tiny import write_clip_vision

    root = tmp_path / "job"
    make_video_dataset(root / "dataset")
    for still in (root / "dataset").glob("still*"):
        still.unlink()
    write_clip_vision(tmp_path / "clip_vision.safetensors")
    config = write_configs(root, model_files("wan_flf2v"), stages=2, epochs=1, model={
        "type": "wan_flf2v", "clip_vision": str(tmp_path / "clip_vision.safetensors")})
    with open(root / "dataset.toml", "a") as f:
        f.write("frame_buckets = [9]\n")
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    store, entries = _entries(root, "wan_flf2v")
    payload = store.get("latents", entries["clip_mp4.mp4"].latent)
    concat, clip_fea = payload["concat"], payload["clip_fea"]
    assert concat.shape == (20, 3, 8, 8) and (concat[:4, 0] == 1).all() and (concat[:4, 1] == 0).all()
    assert (concat[:3, 2] == 0).all() and (concat[3, 2] == 1).all()   # the last pixel frame: 4th channel
    assert clip_fea.shape == (514, 1280) and not torch.allclose(clip_fea[:257], clip_fea[257:])
    assert run.events("engine")[0]["stage_bounds"] == [0, 2, 4]
    check_epoch_loras(run, config, keys=24)   # + cross_attn.k_img / v_img
