# SPDX-License-Identifier: GPL-3.0-or-later
"""Wan VACE's control mask and reference image, and Fun-Control without a start image: the cached conditioning is
what ComfyUI's WanVaceToVideo / WanFunControlToVideo make of the same inputs, the reference's latent frame is in the
noisy input as ComfyUI samples it and out of the loss (TrimVideoLatent), the feed draws its noise, and the dataset
keys pair the files and enter the cache key."""
import pytest
import torch
from feed_stubs import FlowAdapter, cache_entries
from layer_checks import comfy_model, every_boundary_is_a_stage_boundary_with_lora, run_layers

from pipetrain.backend.config import ModelConfig
from pipetrain.backend.errors import ConfigError, DatasetError
from pipetrain.backend.host.runtime import ensure_comfyui

ensure_comfyui()
TEXT = 48


def _frames(seed, count=9, channels=3):
    return torch.rand(count, 32, 48, channels, generator=torch.Generator().manual_seed(seed))


def _vace(**cfg):
    from pipetrain.backend.models.registry import adapter_class
    from pipetrain.backend.models.wan import wan_config

    config = {**wan_config(64, 96, 4, model_type="vace"), "vace_in_dim": 96, "vace_layers": 2,
              "num_heads": 2, "text_dim": TEXT, "freq_dim": 32}
    adapter = adapter_class("wan_vace")(ModelConfig(type="wan_vace", diffusion_model="unused", vae="unused", **cfg))
    adapter.dtype = torch.float64
    adapter.use_model(comfy_model("wan_vace", config, std=0.08))
    return adapter


@pytest.fixture(scope="module")
def vace():
    return _vace()


def _node_conds(vae, frames, **inputs):
    """WanVaceToVideo's output through WAN21_Vace.extra_conds: (vace_context [96, T, h, w], trim_latent)."""
    from pipetrain.backend.models.wan import nodes_wan
    from pipetrain.backend.models.wan_control import wan_vace_config

    text = [[torch.zeros(1, 1, 8), {}]]
    positive, _, latent, trim = nodes_wan().WanVaceToVideo.execute(text, text, vae, 48, 32, frames, 1, 1.0,
                                                                    **inputs).args
    model = comfy_model("wan_vace", {**wan_vace_config("tiny"), "num_layers": 1}, dtype=torch.float32).model
    values = positive[0][1]
    conds = model.extra_conds(noise=torch.zeros(latent["samples"].shape), device="cpu",
                              vace_frames=values["vace_frames"], vace_mask=values["vace_mask"],
                              vace_strength=values["vace_strength"])
    return conds["vace_context"].cond[0, 0], trim


def test_vace_mask_and_reference_conditioning_is_comfyuis(model_files, vace):
    """A mask video (its red channel, as the node's MASK) and a reference image give WanVaceToVideo's output: the
    reference's latent frame in front (trim_latent 1), its mask frame zero; another mask or reference changes it."""
    from pipetrain.backend.models import loading

    vae = loading.load_vae(model_files("wan").vae)
    clip, control, mask, reference = _frames(0), _frames(1), (_frames(2) > 0.5).float(), _frames(4, count=1)
    ours = vace.encode_conditioning(vae, clip, control, control_mask=mask, reference=reference)["vace_context"]
    theirs, trim = _node_conds(vae, 9, control_video=control, control_masks=mask[..., 0], reference_image=reference)
    assert trim == 1 and ours.shape == (96, 4, 4, 6)
    assert torch.allclose(ours, theirs, atol=1e-5)
    assert (ours[32:, 0] == 0).all() and not (ours[32:, 1:] == 1).all()    # a real mask, not the all-ones default
    plain = vace.encode_conditioning(vae, clip, control)["vace_context"]
    assert plain.shape == (96, 3, 4, 6) and not torch.allclose(plain[:32], ours[:32, 1:])   # the mask splits it
    masked_only = vace.encode_conditioning(vae, clip, control, control_mask=mask)["vace_context"]
    assert torch.allclose(masked_only, ours[:, 1:], atol=1e-5)        # the reference only adds its frame
    other = vace.encode_conditioning(vae, clip, control, control_mask=mask, reference=_frames(5, count=1))
    assert not torch.allclose(other["vace_context"][:16, 0], ours[:16, 0])
    # a mask image is one frame: the node pads the others with 1 (generate everywhere)
    still_mask = vace.encode_conditioning(vae, clip, control, control_mask=mask[:1])["vace_context"]
    theirs, _ = _node_conds(vae, 9, control_video=control, control_masks=mask[:1, ..., 0])
    assert torch.allclose(still_mask, theirs, atol=1e-5)


def _reference_inputs(seed=1, batch=2, size=(3, 6, 10)):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(batch, 16, *size, generator=g, dtype=torch.float64)
    noise = torch.randn(x0.shape, generator=g, dtype=torch.float64)
    t = torch.tensor([0.25, 0.8], dtype=torch.float64)
    text = torch.randn(batch, 7, TEXT, generator=g, dtype=torch.float64)
    vace = torch.randn(batch, 96, size[0] + 1, *size[1:], generator=g, dtype=torch.float64)   # a reference frame
    ref_noise = torch.randn(batch, 16, 1, *size[1:], generator=g, dtype=torch.float64)
    return x0, noise, t, text, vace, ref_noise


def test_the_reference_frame_is_sampled_as_comfyui_does_and_left_out_of_the_loss(vace):
    """The layers see [the reference latent noised with its own noise, the noisy clip] as ComfyUI's model sees the
    node's longer latent, and predict the clip's frames only: the loss is ComfyUI's prediction with the reference
    frame trimmed (TrimVideoLatent) against the clip's target, not one that counts the reference frame."""
    a = vace
    x0, noise, t, text, vace_context, ref_noise = inputs = _reference_inputs()
    objective = a.objective()
    reference = vace_context[:, :16, :1]
    x_full = objective.noisy(torch.cat([reference, x0], 2), torch.cat([ref_noise, noise], 2), t)
    with torch.no_grad():
        ours = run_layers(a.to_layers(), inputs)
        comfy = a.reference_forward(x_full, t, [text, vace_context])
        loss = a.loss(ours, (x0, noise, t))
    assert ours.shape == x0.shape and comfy.shape[2] == x0.shape[2] + 1
    assert torch.allclose(ours, comfy[:, :, 1:], atol=1e-10, rtol=1e-8)
    target = objective.target(x0, noise, t)
    assert torch.allclose(loss, ((comfy[:, :, 1:] - target) ** 2).mean())
    full_target = objective.target(torch.cat([reference, x0], 2), torch.cat([ref_noise, noise], 2), t)
    assert not torch.allclose(loss, ((comfy - full_target) ** 2).mean(), rtol=1e-3)
    # the reference slot is the cached reference latent noised by ref_noise: other values give another prediction
    with torch.no_grad():
        other = run_layers(a.to_layers(), (x0, noise, t, text, vace_context, torch.zeros_like(ref_noise)))
    assert not torch.allclose(other, ours)


def test_a_reference_frame_crosses_every_stage_boundary():
    every_boundary_is_a_stage_boundary_with_lora(_vace(), _reference_inputs())


def test_the_feed_draws_the_reference_frames_noise_from_the_samples_seed(vace):
    """Per sample, its own stream (not the latent's noise), the same however the batch is split."""
    from pipetrain.backend.train.feed import MicroBatchFeed

    class Store:
        def get(self, kind, key, encode_again=None, needs=()):
            g = torch.Generator().manual_seed(len(key))
            if kind == "latents":
                return {"latent": torch.randn(16, 2, 4, 4, generator=g),
                        "vace_context": torch.randn(96, 3, 4, 4, generator=g)}
            return {"x": torch.zeros(1)}

    class Adapter(FlowAdapter):
        conditioning_fields = ("vace_context",)
        extra_noise_shape = vace.extra_noise_shape

    entries = cache_entries(4)
    (_, noise, _, _, cond, ref_noise), _ = MicroBatchFeed(Adapter(), Store(), 3, 0, 1).build(entries, 1, 2, 0)
    assert cond.shape == (4, 96, 3, 4, 4) and ref_noise.shape == (4, 16, 1, 4, 4)
    assert not torch.allclose(ref_noise[:, :, 0], noise[:, :, 0]) and ref_noise.std() > 0.5
    (_, _, _, _, _, second), _ = MicroBatchFeed(Adapter(), Store(), 3, 1, 2).build(entries[2:], 1, 2, 0)
    assert torch.equal(second, ref_noise[2:])
    assert vace.extra_noise_shape({"latent": torch.zeros(16, 2, 4, 4), "vace_context": torch.zeros(96, 2, 4, 4)}) \
        is None   # no reference: the inputs stay as they were


def _fun_control(**cfg):
    from pipetrain.backend.models.registry import adapter_class
    from pipetrain.backend.models.wan import wan_config

    config = {**wan_config(64, 96, 2, in_dim=48, model_type="i2v"), "num_heads": 2, "text_dim": TEXT,
              "freq_dim": 32}
    adapter = adapter_class("wan_fun_control")(ModelConfig(type="wan_fun_control", diffusion_model="unused",
                                                           vae="unused", **cfg))
    adapter.use_model(comfy_model("wan_fun_control", config, dtype=torch.float32))
    return adapter


def test_fun_control_without_a_start_image_is_comfyuis_and_trains_stills(model_files):
    from pipetrain.backend.models import loading
    from pipetrain.backend.models.wan import nodes_wan
    from pipetrain.backend.models.wan_control import wan_fun_control_config

    a = _fun_control(control_start_image=False)
    vae = loading.load_vae(model_files("wan").vae)
    clip, control = _frames(0), _frames(1)
    ours = a.encode_conditioning(vae, clip, control)["concat"]
    text = [[torch.zeros(1, 1, 8), {}]]
    positive, _, latent = nodes_wan().WanFunControlToVideo.execute(text, text, vae, 48, 32, 9, 1,
                                                                    control_video=control).args
    model = comfy_model("wan_fun_control", {**wan_fun_control_config("tiny"), "num_layers": 1},
                        dtype=torch.float32).model
    assert torch.allclose(ours, model.concat_cond(noise=torch.zeros(latent["samples"].shape), device="cpu",
                                                  **positive[0][1])[0], atol=1e-5)
    assert (ours[16:] == 0).all()     # no start image: zeros after the scaling
    with_start = _fun_control().encode_conditioning(vae, clip, control)["concat"]
    assert with_start[16:, 0].abs().sum() > 0 and torch.allclose(with_start[:16], ours[:16])
    assert a.encode_conditioning(vae, clip[:1], control[:1])["concat"].shape == (32, 1, 4, 6)   # a still trains
    assert a.conditioning_options() == {"start_image": False} and _fun_control().conditioning_options() == {}


def test_the_keys_are_refused_where_they_do_nothing(tmp_path):
    from pipetrain.backend.config import DatasetConfig, DirectoryConfig
    from pipetrain.backend.data import check_control_paths
    from pipetrain.backend.models.registry import adapter_class

    with pytest.raises(ConfigError, match="model.control_start_image"):
        adapter_class("wan_vace").check_config(ModelConfig(type="wan_vace", diffusion_model="x", vae="x",
                                                           control_start_image=False), "f.toml")
    with pytest.raises(ConfigError, match="model.control_start_image"):
        adapter_class("wan_fun_control").check_config(ModelConfig(
            type="wan_fun_control", diffusion_model="x", vae="x", control_start_image=False, clip_vision="c"), "f")
    for key in ("control_mask_path", "reference_path"):
        ds = DatasetConfig(directory=[DirectoryConfig(path="a", control_path="c", **{key: "m"})])
        with pytest.raises(DatasetError, match=f"{key}, which only 'wan_vace' takes.*choose type = 'wan_vace'"):
            check_control_paths(ds, adapter_class("wan_fun_control"), "dataset")
        check_control_paths(ds, adapter_class("wan_vace"), "dataset")   # VACE takes it
    ds = DatasetConfig(directory=[DirectoryConfig(path="a", control_path="c", reference_path="r"),
                                  DirectoryConfig(path="b", control_path="c")])
    with pytest.raises(DatasetError, match="some directories set reference_path"):
        check_control_paths(ds, adapter_class("wan_vace"), "dataset")


def _dataset(tmp_path, **keys):
    from PIL import Image

    from pipetrain.backend.config import DatasetConfig, DirectoryConfig

    for folder in ("clips", "controls", "masks", "refs"):
        (tmp_path / folder).mkdir(exist_ok=True)
        for stem in ("a", "b"):
            Image.new("RGB", (32, 32), (len(folder) * 20, 0, 0)).save(tmp_path / folder / f"{stem}.png")
    Image.new("RGB", (32, 32), (9, 9, 9)).save(tmp_path / "one.png")
    return DatasetConfig(directory=[DirectoryConfig(path=str(tmp_path / "clips"),
                                                    control_path=str(tmp_path / "controls"), **keys)])


def test_masks_and_references_pair_by_stem_and_enter_the_cache_key(tmp_path):
    from types import SimpleNamespace

    from pipetrain.backend.cache.manifest import build_entries
    from pipetrain.backend.data import scan_dataset
    from pipetrain.backend.data.items import Example

    items = scan_dataset(_dataset(tmp_path, control_mask_path=str(tmp_path / "masks"),
                                  reference_path=str(tmp_path / "refs"))).items
    assert [(i.control_mask.parent.name, i.reference.parent.name, i.control_mask.stem) for i in items] == \
        [("masks", "refs", "a"), ("masks", "refs", "b")]
    one = scan_dataset(_dataset(tmp_path, reference_path=str(tmp_path / "one.png"))).items
    assert [i.reference.name for i in one] == ["one.png", "one.png"] and one[0].control_mask is None
    unpaired = _dataset(tmp_path, control_mask_path=str(tmp_path / "masks"))
    (tmp_path / "masks" / "b.png").unlink()
    with pytest.raises(DatasetError, match="control_mask_path"):
        scan_dataset(unpaired)
    with pytest.raises(DatasetError, match="directory.reference_path"):
        scan_dataset(_dataset(tmp_path, reference_path=str(tmp_path / "nowhere")))

    adapter = SimpleNamespace(conditioning_fields=("vace_context",), text_options=dict, arch="wan_vace", latent_format="Wan21",
                              caption_sees_control=False, conditioning_options=dict)
    files = {"vae": [tmp_path / "one.png"], "text_encoders": []}

    def key(item):
        return build_entries([Example(item, (32, 32))], adapter, files, fingerprint=lambda p: "fp")[0]
    plain, with_ref = key(items[0].__class__(**{**vars(items[0]), "reference": None})), key(items[0])
    assert with_ref.reference.endswith("refs/a.png") and with_ref.control_mask.endswith("masks/a.png")
    assert plain.latent != with_ref.latent
    from PIL import Image
    Image.new("RGB", (32, 32), (1, 2, 3)).save(tmp_path / "masks" / "a.png")
    assert key(items[0]).latent != with_ref.latent      # another mask file: another cache entry


def test_the_nodes_set_the_keys(tmp_path, monkeypatch):
    """Dataset node: control_mask_folder / reference -> control_mask_path / reference_path (empty: left out); Model
    node: control_start_image off -> false (on: the key left out, so other models take the node as before)."""
    from pipetrain.backend.commands.demo import make_dataset
    from pipetrain.nodes.data import DatasetNode, ModelNode

    make_dataset(tmp_path / "a", 1)
    args = dict(resolutions="512", enable_ar_bucket=False, min_ar=0.5, max_ar=2.0, num_ar_buckets=1, num_repeats=1,
                caption_extension=".txt")
    spec = DatasetNode.execute(str(tmp_path / "a"), control_mask_folder=str(tmp_path / "m"),
                               reference=str(tmp_path / "r.png"), **args).result[0]
    (d,) = spec.table()["directory"]
    assert (d["control_mask_path"], d["reference_path"]) == (str(tmp_path / "m"), str(tmp_path / "r.png"))
    (plain,) = DatasetNode.execute(str(tmp_path / "a"), **args).result[0].table()["directory"]
    assert "control_mask_path" not in plain and "reference_path" not in plain

    import folder_paths

    import pipetrain.nodes.data as data
    patches = []
    monkeypatch.setattr(data, "check_model_patch", patches.append)   # the node's inputs as [model], unchecked
    monkeypatch.setattr(data, "model_input_error", lambda *a: None)
    monkeypatch.setattr(data, "model_path", lambda name: name)
    monkeypatch.setattr(data, "detect", lambda path, model_type: model_type)
    monkeypatch.setattr(data, "parity_text", lambda model_type: "")
    monkeypatch.setattr(folder_paths, "get_full_path_or_raise", lambda kind, name: name)
    # the node takes only the files its combos list (nodes/declared.py)
    monkeypatch.setattr(folder_paths, "get_filename_list", lambda kind: ["dm", "t1", "vae"])
    for value in (False, True):
        ModelNode.execute("dm", "t1", "none", "vae", "default", "bfloat16", model_type="wan_fun_control",
                          control_start_image=value)
    assert [p.get("model.control_start_image") for p in patches] == [False, None]
