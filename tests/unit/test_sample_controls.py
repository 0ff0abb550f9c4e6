# SPDX-License-Identifier: GPL-3.0-or-later
"""Control-video models' epoch samples render with a control: the conditioning handed to ComfyUI's sampler carries
the VAE encoding of the dataset's first control clip (cut to the sample's frames), wan_vace's control mask and
reference image (the reference's latent frame trimmed from the clip, as TrimVideoLatent does), wan_fun_control's
start image (the controlled clip's first frame, [samples] start_image, or none with control_start_image = false);
a dataset without controls is refused naming the key."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from pipetrain.backend.errors import ConfigError
from sample_capture import encoded, picture, render_capturing, solid, webp_clip

CONTROL = [(250, 10, 10), (10, 250, 10), (10, 10, 250), (250, 250, 10), (10, 250, 250), (250, 10, 250),
           (90, 90, 90), (200, 200, 200), (30, 30, 30)]   # 9 frames; the samples take the first 5
CLIP = [(20, 90, 220)] + [(240, 240, 10)] * 8


def _controlled_run(files, make_run, arch, name="job", model=None, samples=None, clip="a_clip", **folders):
    """A run whose dataset pairs a clip (``clip``) and an image (img00) with controls (controls/, the clip's a
    9-frame video); ``folders``: further [[directory]] keys -> {file name: writer} in a folder of that name."""
    config = make_run(files, images=1, name=name, model={"type": arch, **(model or {})}, samples={
        "prompts": ["a fox"], "width": 64, "height": 64, "steps": 1, "frames": 5, **(samples or {})})
    root = config.parent
    webp_clip(root / "dataset" / f"{clip}.webp", CLIP)
    (root / "controls").mkdir()
    webp_clip(root / "controls" / f"{clip}.webp", CONTROL)
    Image.new("RGB", (64, 64), (1, 2, 3)).save(root / "controls" / "img00.png")
    lines = [f'control_path = "{root / "controls"}"']
    for key, written in folders.items():
        (root / key).mkdir()
        for file, write in written.items():
            write(root / key / file)
        lines.append(f'{key} = "{root / key}"')
    with open(root / "dataset.toml", "a") as f:   # lands in the [[directory]] table
        f.write("\n".join(lines) + "\n")
    return config


def _vace_node(vae, **inputs):
    from pipetrain.backend.models.wan import nodes_wan

    text = [[torch.zeros(1, 1, 8), {}]]
    positive, _, latent, trim = nodes_wan().WanVaceToVideo.execute(text, text, vae, 64, 64, 5, 1, 1.0, **inputs).args
    return positive[0][1], latent, trim


@pytest.mark.parametrize("clip", ["a_clip", "z_clip"])
def test_vace_samples_carry_the_datasets_control_clip(clip, model_files, make_run, monkeypatch, tmp_path):
    """No mask: the node's reactive half is the control's own latent (its first 5 frames at the sample size), the
    inactive half grey, the mask all ones; the negative prompt gets the same control. The clip's control is taken
    before a still's (img00's control image) that sorts first."""
    config = _controlled_run(model_files("wan_vace"), make_run, "wan_vace", clip=clip)
    calls, paths, vae = render_capturing(config, monkeypatch, tmp_path)

    [call] = calls
    cond = call["positive"][0][1]
    frames = cond["vace_frames"][0].float()                                # [1, 32, 2, 8, 8]
    assert frames.shape == (1, 32, 2, 8, 8) and call["latent"].shape == (1, 16, 2, 8, 8)
    torch.testing.assert_close(frames[:, 16:], encoded(vae, solid(CONTROL[:5])), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(frames[:, :16], encoded(vae, torch.full((5, 64, 64, 3), 0.5)), rtol=1e-4, atol=1e-5)
    assert (cond["vace_mask"][0] == 1).all() and cond["vace_strength"] == [1.0]
    assert torch.equal(call["negative"][0][1]["vace_frames"][0], cond["vace_frames"][0])
    with Image.open(paths[0]) as clip:
        assert clip.n_frames == 5


def _half_mask(path):
    mask = Image.new("RGB", (64, 64), (0, 0, 0))
    mask.paste((255, 255, 255), (0, 0, 32, 64))   # generate on the left half, keep the control's right half
    mask.save(path)


def test_vace_samples_carry_the_items_mask_and_reference(model_files, make_run, monkeypatch, tmp_path):
    """The item's control mask (an image: the node pads the other frames with ones) and reference image give what
    WanVaceToVideo makes of the same pixels; the reference's latent frame leads the sampled latent and is trimmed
    before decoding (a 5-frame clip, not 9)."""
    def reference(path):
        picture(path, (200, 120, 40), size=(64, 64))

    config = _controlled_run(model_files("wan_vace"), make_run, "wan_vace",
                             control_mask_path={"a_clip.png": _half_mask, "img00.png": _half_mask},
                             reference_path={"a_clip.png": reference, "img00.png": reference})
    calls, paths, vae = render_capturing(config, monkeypatch, tmp_path)

    [call] = calls
    cond = call["positive"][0][1]
    from pipetrain.backend.data import load_pixels

    ref = load_pixels(config.parent / "reference_path" / "a_clip.png", (64, 64))[None]
    mask = torch.zeros(1, 64, 64)
    mask[..., :32] = 1.0
    theirs, latent, trim = _vace_node(vae, control_video=solid(CONTROL[:5]), control_masks=mask, reference_image=ref)
    assert trim == 1 and call["latent"].shape == latent["samples"].shape == (1, 16, 3, 8, 8)
    torch.testing.assert_close(cond["vace_frames"][0].float(), theirs["vace_frames"][0].float(), rtol=1e-4,
                               atol=1e-5)
    torch.testing.assert_close(cond["vace_mask"][0], theirs["vace_mask"][0])
    torch.testing.assert_close(cond["vace_frames"][0][:, :16, :1].float(), encoded(vae, ref)[:, :, :1], rtol=1e-4,
                               atol=1e-5)                                   # the reference's own latent in front
    inactive = cond["vace_frames"][0][:, :16, 1:].float()   # the control kept under the mask's black half
    assert (inactive - encoded(vae, torch.full((5, 64, 64, 3), 0.5))).abs().max() > 1e-3   # not the unmasked grey
    with Image.open(paths[0]) as clip:
        assert clip.n_frames == 5                                           # the reference frame trimmed


@pytest.mark.parametrize("start", ["clip", "given", "none"])
def test_fun_control_samples_carry_the_control_and_start_image(start, model_files, make_run, monkeypatch, tmp_path):
    """WanFunControlToVideo's concat: the control's latent, then the start image's (the controlled clip's first
    frame, or [samples] start_image); control_start_image = false: those channels stay the node's empty latent."""
    given = picture(tmp_path / "start.png", (30, 160, 90), size=(64, 64))
    config = _controlled_run(model_files("wan_fun_control"), make_run, "wan_fun_control",
                             model={"control_start_image": False} if start == "none" else None,
                             samples={"start_image": str(given)} if start == "given" else None)
    calls, _, vae = render_capturing(config, monkeypatch, tmp_path)

    [call] = calls
    concat = call["positive"][0][1]["concat_latent_image"].float()       # [1, 32, 2, 8, 8]
    assert concat.shape == (1, 32, 2, 8, 8)
    torch.testing.assert_close(concat[:, :16], encoded(vae, solid(CONTROL[:5])), rtol=1e-4, atol=1e-5)
    import comfy.latent_formats
    empty = comfy.latent_formats.Wan21().process_out(torch.zeros(1, 16, 2, 8, 8))
    if start == "none":
        torch.testing.assert_close(concat[:, 16:], empty)
        return
    from pipetrain.backend.data import load_pixels
    first = solid(CLIP[:1]) if start == "clip" else load_pixels(given, (64, 64))[None]
    torch.testing.assert_close(concat[:, 16:, :1], encoded(vae, first)[:, :, :1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(concat[:, 16:, 1:], empty[:, :, 1:])


def test_control_samples_need_a_control_and_fun_control_without_start_refuses_one(model_files, make_run, tmp_path):
    from pipetrain.backend.sampling import render as sampling
    from pipetrain.backend.config import load_run_config
    from pipetrain.backend.sampling.clips import check_samples

    config = make_run(model_files("wan_vace"), images=1, model={"type": "wan_vace"}, samples={"prompts": ["x"]})
    with pytest.raises(ConfigError, match="samples.*control video.*set control_path"):
        sampling.render(load_run_config(config), tmp_path / "run-epoch0001.safetensors")
    start = picture(tmp_path / "start.png", (1, 2, 3))
    config = make_run(model_files("wan_fun_control"), images=1, name="fun", samples={
        "prompts": ["x"], "start_image": str(start)}, model={"type": "wan_fun_control", "control_start_image": False})
    with pytest.raises(ConfigError, match="samples.start_image.*control_start_image = false"):
        check_samples(load_run_config(config))


@pytest.mark.parametrize("arch", ["wan_vace", "wan_fun_control"])
def test_control_samples_render_through_comfyuis_model(arch, model_files, make_run, monkeypatch, tmp_path):
    """ComfyUI's own sampler and model take the conditioning (wan_vace with a reference: the longer latent, then
    trimmed): a 5-frame clip comes out, and another control gives another clip."""
    from pipetrain.backend.sampling import render as sampling
    from pipetrain.backend.config import load_run_config

    def reference(path):
        picture(path, (200, 120, 40), size=(64, 64))

    monkeypatch.setattr(sampling, "_with_lora", lambda patcher, path, strength=1.0: patcher)
    refs = {"reference_path": {"a_clip.png": reference, "img00.png": reference}} if arch == "wan_vace" else {}
    config = _controlled_run(model_files(arch), make_run, arch, samples={"steps": 2}, **refs)
    cfg = load_run_config(config)
    [path] = sampling.render(cfg, tmp_path / "run-epoch0001.safetensors")
    with Image.open(path) as clip:
        assert clip.n_frames == 5
        first = np.asarray(clip.convert("RGB"), dtype=np.float32)
    webp_clip(config.parent / "controls" / "a_clip.webp", CONTROL[::-1])
    [path] = sampling.render(cfg, tmp_path / "run-epoch0002.safetensors")
    with Image.open(path) as clip:
        assert np.abs(np.asarray(clip.convert("RGB"), dtype=np.float32) - first).max() > 1


OTHER = [(120, 40, 200), (40, 200, 120), (200, 120, 40), (60, 60, 180), (180, 60, 60)] * 2   # the first 5 taken


@pytest.mark.parametrize("arch", ["wan_vace", "wan_fun_control"])
def test_samples_control_video_replaces_the_datasets(arch, model_files, make_run, monkeypatch, tmp_path):
    """[samples] control_video is the control the clips render with (wan_vace: the item's mask, drawn for its own
    control, left out: the inactive half grey)."""
    other = webp_clip(tmp_path / "pose.webp", OTHER)
    masks = {"control_mask_path": {"a_clip.png": _half_mask, "img00.png": _half_mask}} if arch == "wan_vace" else {}
    config = _controlled_run(model_files(arch), make_run, arch, samples={"control_video": str(other)}, **masks)
    calls, _, vae = render_capturing(config, monkeypatch, tmp_path)

    cond = calls[0]["positive"][0][1]
    control = encoded(vae, solid(OTHER[:5]))
    if arch == "wan_vace":
        frames = cond["vace_frames"][0].float()
        torch.testing.assert_close(frames[:, 16:], control, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(frames[:, :16], encoded(vae, torch.full((5, 64, 64, 3), 0.5)), rtol=1e-4,
                                   atol=1e-5)
        assert (cond["vace_mask"][0] == 1).all()
    else:
        torch.testing.assert_close(cond["concat_latent_image"][:, :16].float(), control, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(cond["concat_latent_image"][:, 16:, :1].float(),
                                   encoded(vae, solid(CLIP[:1]))[:, :, :1], rtol=1e-4, atol=1e-5)


def test_control_video_against_the_model_type_and_its_file(model_files, make_run, tmp_path):
    from pipetrain.backend.config import load_run_config
    from pipetrain.backend.sampling.clips import check_samples

    def load(arch, name, path):
        config = make_run(model_files(arch), images=1, name=name, model={"type": arch},
                          samples={"prompts": ["x"], "control_video": path})
        cfg = load_run_config(config)
        check_samples(cfg)
        return cfg

    pose = webp_clip(tmp_path / "pose.webp", OTHER)
    (tmp_path / "notes.txt").write_text("no video")
    with pytest.raises(ConfigError, match="samples.control_video.*wan_i2v model samples without a control video.*"
                                          "wan_fun_control, wan_vace"):
        load("wan_i2v", "i2v", str(pose))
    for k, (bad, message) in enumerate([("missing.mp4", "is not a file"), ("notes.txt", "not a readable video")]):
        with pytest.raises(ConfigError, match=f"samples.control_video.*{message}.*name a video or image file"):
            load("wan_vace", f"bad{k}", str(tmp_path / bad))
    still = picture(tmp_path / "pose.png", (5, 6, 7))
    assert load("wan_vace", "still", str(still)).samples.control_video == str(still)   # an image is a control too
    cfg = load("wan_fun_control", "ok", "../pose.webp")
    assert cfg.with_absolute_paths().samples.control_video == str(pose)   # the run folder's copy still finds it


def test_the_samples_nodes_control_video_stays_in_comfyuis_input_folder(monkeypatch, tmp_path):
    from pipetrain.backend.host.runtime import ensure_comfyui

    ensure_comfyui()
    import folder_paths

    from pipetrain.nodes.samples import SamplesNode

    inputs = tmp_path / "input"
    inputs.mkdir()
    webp_clip(inputs / "pose.webp", OTHER)
    (inputs / "pose.mp4").write_text("no video")
    monkeypatch.setattr(folder_paths, "get_input_directory", lambda: str(inputs))
    assert SamplesNode.validate_inputs(control_video="pose.webp") is True
    for bad, message in [("../pose.webp", "without .."), ("pose.mp4", "not a readable video or image"),
                         ("gone.mp4", "is not a file")]:
        assert f"control_video {bad!r}: " in SamplesNode.validate_inputs(control_video=bad), bad
        assert message in SamplesNode.validate_inputs(control_video=bad), bad
    patch = SamplesNode.execute("a fox", control_video="pose.webp").result[0]
    assert patch.get("samples.control_video") == str(inputs / "pose.webp")
    assert SamplesNode.execute("a fox", control_video=" ").result[0].get("samples.control_video") is None
