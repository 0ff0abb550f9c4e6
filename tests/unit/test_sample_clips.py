# SPDX-License-Identifier: GPL-3.0-or-later
"""Video models' epoch samples: the i2v conditioning handed to ComfyUI's sampler carries the VAE encoding of the
start image (the given one, else the dataset clip's first frame), clips are written as animated WebP, and bad
clip lengths and start images are refused naming the key."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from pipetrain.backend.errors import ConfigError
from sample_capture import encoded, picture, render_capturing, solid, webp_clip


def test_wan_i2v_samples_carry_the_start_images_latent(model_files, make_run, monkeypatch, tmp_path):
    files = model_files("wan_i2v")
    start = picture(tmp_path / "start.png", (30, 160, 90))
    config = make_run(files, images=1, model={"type": "wan_i2v"}, samples={
        "prompts": ["a fox"], "width": 64, "height": 64, "steps": 1, "frames": 5, "start_image": str(start)})
    calls, paths, vae = render_capturing(config, monkeypatch, tmp_path)
    from pipetrain.backend.data import load_pixels

    [call] = calls
    concat = call["positive"][0][1]["concat_latent_image"].float()
    assert concat.shape[2] == 2                                           # 5 frames: 2 latent frames
    direct = encoded(vae, load_pixels(start, (64, 64))[None])          # the image alone (the VAE is causal)
    torch.testing.assert_close(concat[:, :, :1], direct[:, :, :1], rtol=1e-4, atol=1e-5)
    assert call["negative"][0][1]["concat_latent_image"] is call["positive"][0][1]["concat_latent_image"]
    mask = call["positive"][0][1]["concat_mask"]
    assert mask[:, :, 0].max() == 0 and mask[:, :, 1].min() == 1        # the first latent frame given
    [path] = paths
    with Image.open(path) as clip:
        assert (path.suffix, clip.format, clip.n_frames, clip.size) == (".webp", "WEBP", 5, (64, 64))


@pytest.mark.parametrize("arch,latent_frames", [("ltx_video_i2v", 2), ("wan22_5b_i2v", 3)])
def test_i2v_samples_start_from_the_datasets_first_clip_frame(arch, latent_frames, model_files, make_run, monkeypatch,
                                                              tmp_path):
    """No start_image: the first frame of the dataset's first clip (by name), read from the file; LTX-Video's
    LTXVImgToVideo and Wan 2.2's Wan22ImageToVideoLatent put its latent in the sampled latent's first frame and mask
    it from the noise."""
    config = make_run(model_files(arch), images=1, model={"type": arch}, samples={
        "prompts": ["a fox"], "width": 64, "height": 64, "steps": 1, "frames": 9})
    dataset = config.parent / "dataset"
    webp_clip(dataset / "b_clip.webp", [(200, 30, 30)] * 9)
    webp_clip(dataset / "a_clip.webp", [(20, 90, 220)] + [(240, 240, 10)] * 8)
    calls, paths, vae = render_capturing(config, monkeypatch, tmp_path)

    [call] = calls
    first = torch.zeros(1, 64, 64, 3)
    first[..., :] = torch.tensor([20, 90, 220]) / 255.0
    latent = call["latent"]
    assert latent.shape[2] == latent_frames                              # 9 frames: 8k + 1 or 4k + 1
    torch.testing.assert_close(latent[:, :, :1].float(), encoded(vae, first)[:, :, :1], rtol=1e-4, atol=1e-5)
    other = encoded(vae, torch.full((1, 64, 64, 3), 240 / 255.0))
    assert (latent[:, :, :1].float() - other[:, :, :1]).abs().max() > 1e-3   # not just any frame
    assert call["noise_mask"][:, :, 0].max() == 0 and call["noise_mask"][:, :, 1].min() == 1
    with Image.open(paths[0]) as clip:
        assert clip.n_frames == 9


def test_a_clip_is_an_animated_webp_at_the_frame_rate(tmp_path):
    from pipetrain.backend.sampling.clips import save_clip

    pixels = torch.linspace(0, 1, 5)[:, None, None, None].expand(5, 32, 48, 3)
    save_clip(pixels, tmp_path / "c.webp", fps=8)
    with Image.open(tmp_path / "c.webp") as clip:
        clip.seek(4)
        clip.load()
        assert (clip.n_frames, clip.size, clip.info["duration"]) == (5, (48, 32), 125)
        assert np.asarray(clip.convert("RGB")).mean() > 240                 # the last frame is the white one


def _load(files, make_run, name="job", **samples):
    from pipetrain.backend.config import load_run_config
    from pipetrain.backend.sampling.clips import check_samples

    model = {"type": samples.pop("type", "wan_i2v")}
    config = make_run(files, images=1, name=name, model=model, samples={"prompts": ["x"], **samples})
    cfg = load_run_config(config)
    check_samples(cfg)
    return cfg


@pytest.mark.parametrize("start,message", [("missing.png", "is not a file"), ("notes.txt", "not a readable image"),
                                           ("folder", "is not a file")])
def test_bad_start_images_are_refused_naming_the_key(start, message, model_files, make_run, tmp_path):
    (tmp_path / "folder").mkdir()
    (tmp_path / "notes.txt").write_text("not an image")
    with pytest.raises(ConfigError, match=f"samples.start_image.*{message}"):
        _load(model_files("wan_i2v"), make_run, start_image=str(tmp_path / start))


def test_start_image_and_frames_against_the_model_type(model_files, make_run, tmp_path):
    start = picture(tmp_path / "start.png", (1, 2, 3))
    with pytest.raises(ConfigError, match="samples.start_image.*only the image-to-video types.*wan_i2v"):
        _load(model_files("wan"), make_run, name="t2v", type="wan", start_image=str(start))
    with pytest.raises(ConfigError, match=r"samples.frames.*4k \+ 1 frames long, e.g. 9 or 13"):
        _load(model_files("wan_i2v"), make_run, name="odd", frames=10)
    with pytest.raises(ConfigError, match=r"samples.frames.*8k \+ 1.*e.g. 9 or 17"):
        _load(model_files("ltx_video_i2v"), make_run, name="ltx", type="ltx_video_i2v", frames=13)
    cfg = _load(model_files("wan_i2v"), make_run, name="ok", start_image="../start.png", frames=9)
    assert cfg.with_absolute_paths().samples.start_image == str(start)   # the run folder's copy still finds it


def test_the_samples_nodes_start_image_stays_in_comfyuis_input_folder(monkeypatch, tmp_path):
    from pipetrain.backend.host.runtime import ensure_comfyui

    ensure_comfyui()
    import folder_paths

    from pipetrain.nodes.samples import SamplesNode, input_image_path

    inputs = tmp_path / "input"
    (inputs / "sub").mkdir(parents=True)
    picture(inputs / "sub" / "start.png", (5, 6, 7))
    picture(tmp_path / "outside.png", (5, 6, 7))
    (inputs / "escape.png").symlink_to(tmp_path / "outside.png")
    (inputs / "text.png").write_text("no image")
    monkeypatch.setattr(folder_paths, "get_input_directory", lambda: str(inputs))
    assert input_image_path("sub/start.png", "start_image") == inputs / "sub" / "start.png"
    for bad, message in [("../outside.png", "without .."), (str(tmp_path / "outside.png"), "absolute path"),
                         ("escape.png", "leads out"), ("nothing.png", "is not a file"),
                         ("text.png", "not a readable image")]:
        assert message in SamplesNode.validate_inputs(start_image=bad), bad
        assert f"end_image {bad!r}: " in SamplesNode.validate_inputs(end_image=bad), bad
    # at queue time (ComfyUI's event loop) the header alone is read; the node, when it runs, reads the image whole
    whole = (inputs / "sub" / "start.png").read_bytes()
    (inputs / "damaged.png").write_bytes(whole[:-20])      # cut short: its header still reads
    assert SamplesNode.validate_inputs(start_image="damaged.png") is True
    with pytest.raises(ValueError, match="start_image 'damaged.png': .* is not a readable image"):
        SamplesNode.execute("a fox", start_image="damaged.png")
    patch = SamplesNode.execute("a fox", start_image="sub/start.png", frames=33, fps=0.0).result[0]
    assert (patch.get("samples.start_image"), patch.get("samples.frames"), patch.get("samples.fps")) == (
        str(inputs / "sub" / "start.png"), 33, None)
    assert patch.get("samples.end_image") is None
    patch = SamplesNode.execute("a fox", end_image=" sub/start.png").result[0]
    assert (patch.get("samples.end_image"), patch.get("samples.start_image")) == (str(inputs / "sub" / "start.png"),
                                                                                None)


def test_first_last_frame_samples_take_the_clips_first_and_last_frames(model_files, make_run, monkeypatch, tmp_path):
    """wan_flf2v without a start image: WanFirstLastFrameToVideo gets the dataset clip's first and last frames (the
    mask keeps both; the last latent frame is not that of grey frames)."""
    config = make_run(model_files("wan_flf2v"), images=1, model={"type": "wan_flf2v"}, samples={
        "prompts": ["a fox"], "width": 64, "height": 64, "steps": 1, "frames": 5})
    webp_clip(config.parent / "dataset" / "clip.webp", [(20, 90, 220)] + [(128, 128, 128)] * 3 + [(250, 20, 20)])
    calls, _, vae = render_capturing(config, monkeypatch, tmp_path)

    [call] = calls
    cond = call["positive"][0][1]
    first = torch.zeros(1, 64, 64, 3)
    first[..., :] = torch.tensor([20, 90, 220]) / 255.0
    torch.testing.assert_close(cond["concat_latent_image"][:, :, :1].float(), encoded(vae, first)[:, :, :1],
                               rtol=1e-4, atol=1e-5)
    last = torch.zeros(1, 64, 64, 3)
    last[..., :] = torch.tensor([250, 20, 20]) / 255.0
    grey = torch.full((3, 64, 64, 3), 0.5)
    both = encoded(vae, torch.cat([first, grey, last]))                 # the node's clip, encoded here
    grey_end = encoded(vae, torch.cat([first, grey, torch.full((1, 64, 64, 3), 0.5)]))
    concat = cond["concat_latent_image"].float()
    torch.testing.assert_close(concat, both, rtol=1e-4, atol=1e-5)
    assert (concat - grey_end).abs().max() > 1e-4                         # the last frame is in it
    mask = cond["concat_mask"]   # [1, 4, latent frames, h, w]: 0 where a frame is given
    assert mask[0, :, 0].max() == 0 and mask[0, 3, -1].max() == 0 and mask[0, :3, -1].min() == 1


@pytest.mark.parametrize("given_start", [False, True])
def test_first_last_frame_samples_end_on_the_end_image(given_start, model_files, make_run, monkeypatch, tmp_path):
    """wan_flf2v with [samples] end_image: it is WanFirstLastFrameToVideo's end image, after the dataset clip's first
    frame (or the start_image), in place of the clip's last frame."""
    end = picture(tmp_path / "end.png", (200, 30, 120), size=(64, 64))
    start = picture(tmp_path / "start.png", (10, 220, 60), size=(64, 64))
    samples = {"prompts": ["a fox"], "width": 64, "height": 64, "steps": 1, "frames": 5, "end_image": str(end)}
    config = make_run(model_files("wan_flf2v"), images=1, model={"type": "wan_flf2v"},
                      samples={**samples, "start_image": str(start)} if given_start else samples)
    webp_clip(config.parent / "dataset" / "clip.webp", [(20, 90, 220)] + [(128, 128, 128)] * 3 + [(250, 20, 20)])
    calls, _, vae = render_capturing(config, monkeypatch, tmp_path)
    from pipetrain.backend.data import load_pixels

    first = load_pixels(start, (64, 64))[None] if given_start else solid([(20, 90, 220)])
    grey = torch.full((3, 64, 64, 3), 0.5)
    concat = calls[0]["positive"][0][1]["concat_latent_image"].float()
    expected = encoded(vae, torch.cat([first, grey, load_pixels(end, (64, 64))[None]]))
    torch.testing.assert_close(concat, expected, rtol=1e-4, atol=1e-5)
    clip_end = encoded(vae, torch.cat([first, grey, solid([(250, 20, 20)])]))
    assert (concat - clip_end).abs().max() > 1e-4                          # not the clip's last frame


def test_end_image_against_the_model_type_and_its_file(model_files, make_run, tmp_path):
    end = picture(tmp_path / "end.png", (1, 2, 3))
    with pytest.raises(ConfigError, match="samples.end_image.*wan_i2v model samples without an end image.*wan_flf2v"):
        _load(model_files("wan_i2v"), make_run, name="i2v", end_image=str(end))
    (tmp_path / "notes.txt").write_text("not an image")
    for k, (bad, message) in enumerate([("missing.png", "is not a file"), ("notes.txt", "not a readable image")]):
        with pytest.raises(ConfigError, match=f"samples.end_image.*{message}"):
            _load(model_files("wan_flf2v"), make_run, name=f"bad{k}", type="wan_flf2v", end_image=str(tmp_path / bad))
    cfg = _load(model_files("wan_flf2v"), make_run, name="ok", type="wan_flf2v", end_image="../end.png")
    assert cfg.with_absolute_paths().samples.end_image == str(end)       # the run folder's copy still finds it
