# SPDX-License-Identifier: GPL-3.0-or-later
"""Tiny model files in ComfyUI's formats and the loaders: detection, text conds, latents, forward passes."""
import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from pipetrain.backend.errors import ModelError
from pipetrain.backend.models import loading, tiny
from pipetrain.backend.models.flux import build_flux
from pipetrain.backend.models.sdxl import SDXL_UNET_FULL, SDXL_UNET_TINY, build_sdxl_unet
from pipetrain.backend.host.runtime import ensure_comfyui

ensure_comfyui()
import comfy.model_detection  # noqa: E402
import comfy.sd  # noqa: E402
import comfy.supported_models  # noqa: E402

CAPTION = "a photo of a red cube on a wooden table"


@pytest.fixture(scope="module")
def flux_files(tiny_flux_files) -> tiny.ModelFiles:
    return tiny_flux_files


@pytest.fixture(scope="module")
def sdxl_files(tmp_path_factory) -> tiny.ModelFiles:
    """Written through the CLI, whose printed paths must name the files."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert tiny.main(["sdxl", str(tmp_path_factory.mktemp("sdxl"))]) == 0
    paths = {}
    for line in out.getvalue().splitlines():
        role, _, path = line.partition(": ")
        paths.setdefault(role, []).append(Path(path))
    assert all(p.is_file() for ps in paths.values() for p in ps)
    return tiny.ModelFiles(paths["diffusion_model"][0], paths["vae"][0], paths["text_encoder"])


@pytest.fixture(scope="module")
def flux_model(flux_files):
    return loading.load_diffusion_model(flux_files.diffusion_model, torch.float32)


@pytest.fixture(scope="module")
def sdxl_model(sdxl_files):
    return loading.load_diffusion_model(sdxl_files.diffusion_model, torch.float32)


def encode(files: tiny.ModelFiles, arch: str, caption: str = CAPTION) -> dict:
    clip = loading.load_text_encoders(files.text_encoders, arch, torch.float32)
    return clip.encode_from_tokens(clip.tokenize(caption), return_pooled=True, return_dict=True)


@pytest.fixture(scope="module")
def flux_conds(flux_files):
    return encode(flux_files, "flux")


@pytest.fixture(scope="module")
def sdxl_conds(sdxl_files):
    return encode(sdxl_files, "sdxl")


def meta_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {key: torch.empty(shape, device="meta") for key, shape, _ in tiny.tensor_plan(module)}


# --- detection ----------------------------------------------------------------------------------
def test_tiny_flux_is_detected_by_comfyui_as_flux_dev(flux_files, flux_model):
    assert type(flux_model.model).__name__ == "Flux"
    assert type(flux_model.model.model_config) is comfy.supported_models.Flux  # dev: guidance_in present
    params = flux_model.model.diffusion_model.params
    assert (params.hidden_size, params.depth, params.depth_single_blocks) == (3072, 1, 1)
    assert params.guidance_embed and params.vec_in_dim == 768 and params.context_in_dim == 4096
    assert loading.detect_architecture(flux_files.diffusion_model) == "flux"


def test_full_size_configs_match_comfyui_detection_without_weights():
    sdxl = meta_state_dict(build_sdxl_unet("full"))
    assert type(comfy.model_detection.model_config_from_unet(sdxl, "")) is comfy.supported_models.SDXL
    detected = comfy.model_detection.detect_unet_config(sdxl, "")
    assert {k: v for k, v in SDXL_UNET_FULL.items() if k != "num_head_channels"} == detected
    flux = meta_state_dict(build_flux("full"))
    assert type(comfy.model_detection.model_config_from_unet(flux, "")) is comfy.supported_models.Flux
    assert comfy.model_detection.detect_unet_config(flux, "")["depth_single_blocks"] == 38
    assert loading.arch_from_state_dict_shapes({k: v.shape for k, v in sdxl.items()}) == "sdxl"
    expected = {"clip_l": comfy.sd.TEModel.CLIP_L, "clip_g": comfy.sd.TEModel.CLIP_G, "t5xxl": comfy.sd.TEModel.T5_XXL,
                "clip_h": comfy.sd.TEModel.CLIP_H}
    for kind, te_model in expected.items():
        module = tiny.build_text_encoder(kind, tiny.text_encoder_config(kind, "full"))
        assert comfy.sd.detect_te_model(meta_state_dict(module)) == te_model


def test_tiny_sdxl_loads_through_its_metadata(sdxl_files, sdxl_model):
    shapes, metadata = loading.read_header(sdxl_files.diffusion_model)
    assert loading.arch_from_state_dict_shapes(shapes) is None  # ComfyUI alone matches only the real SDXL
    assert json.loads(metadata["pipetrain.unet_config"]) == SDXL_UNET_TINY
    assert loading.detect_architecture(sdxl_files.diffusion_model) == "sdxl"
    assert type(sdxl_model.model).__name__ == "SDXL"
    assert isinstance(sdxl_model.model.model_config, comfy.supported_models.SDXL)
    unet = sdxl_model.model.diffusion_model
    assert (unet.model_channels, unet.num_head_channels) == (32, 16)


def test_a_tiny_file_loads_through_comfyuis_own_loader(sdxl_files, tmp_path, monkeypatch):
    """The tiny flavour exercises the real loader: ComfyUI's ``load_diffusion_model`` with its detection given the
    metadata's config (and put back after); a file its metadata says more of than it holds is refused by name."""
    from safetensors.torch import load_file, save_file

    detect = comfy.model_detection.detect_unet_config
    loaded = []
    real = comfy.sd.load_diffusion_model
    monkeypatch.setattr(comfy.sd, "load_diffusion_model", lambda path, **kw: loaded.append(path) or real(path, **kw))
    patcher = loading.load_diffusion_model(sdxl_files.diffusion_model, torch.float32)
    assert loaded == [str(sdxl_files.diffusion_model)] and type(patcher.model).__name__ == "SDXL"
    assert comfy.model_detection.detect_unet_config is detect
    _, metadata = loading.read_header(sdxl_files.diffusion_model)
    tensors = load_file(sdxl_files.diffusion_model)
    del tensors["out.2.weight"]
    short = tmp_path / "short.safetensors"
    save_file(tensors, short, metadata)
    with pytest.raises(ModelError, match=r"short.safetensors: 1 weights of the sdxl model in its metadata are "
                                         r"missing, e.g. 'out.2.weight'"):
        loading.load_diffusion_model(short, torch.float32)
    assert comfy.model_detection.detect_unet_config is detect


@pytest.mark.parametrize("arch, comfy_class, prediction, context_dim, tokenizer", [
    ("sd15", "SD15", "EPS", 768, "SD1Tokenizer"), ("sd2", "SD20", "V_PREDICTION", 1024, "SD2Tokenizer")])
def test_tiny_sd_files_load_as_comfyui_loads_sd15_and_sd2(model_files, arch, comfy_class, prediction, context_dim,
                                                          tokenizer):
    """ComfyUI builds the tiny SD 1.x / 2.x UNets from their metadata with its own SD15 / SD20 config, and its own
    SD20 check reads the tiny SD 2.x as a 768-v model (v-prediction), as it reads SD 2.1 768-v; CLIP-L / OpenCLIP-H
    give the UNet's context width, the VAE 4 channels."""
    files = model_files(arch)
    patcher = loading.load_diffusion_model(files.diffusion_model, torch.float32)
    assert type(patcher.model.model_config) is getattr(comfy.supported_models, comfy_class)
    assert patcher.model.model_type.name == prediction
    assert patcher.model.diffusion_model.model_channels == 32
    assert loading.detect_architecture(files.diffusion_model) == arch
    clip = loading.load_text_encoders(files.text_encoders, arch, torch.float32)
    assert type(clip.tokenizer).__name__ == tokenizer
    cond = clip.encode_from_tokens(clip.tokenize(CAPTION), return_dict=True)["cond"]
    assert cond.shape == (1, 77, context_dim) == (1, 77, patcher.model.model_config.unet_config["context_dim"])
    assert loading.load_vae(files.vae, arch=arch).encode(torch.rand(1, 64, 64, 3)).shape == (1, 4, 8, 8)


# --- text encoders, VAE ---------------------------------------------------------------------------
def test_tiny_text_encoders_load_through_comfyuis_own_text_encoder_loading(flux_files, monkeypatch):
    """As real files do (``load_clip`` runs it on their tensors): ComfyUI's dispatch picks Flux's text-encoder
    classes by the clip type, each file loads into its encoder, and the detection is ComfyUI's own again after."""
    detect = comfy.sd.detect_te_model
    calls = []
    real = comfy.sd.load_text_encoder_state_dicts
    monkeypatch.setattr(comfy.sd, "load_text_encoder_state_dicts",
                        lambda sds, **kw: calls.append(kw["clip_type"]) or real(sds, **kw))
    clip = loading.load_text_encoders(flux_files.text_encoders, "flux", torch.float32)
    assert calls == [comfy.sd.CLIPType.FLUX]
    assert type(clip.tokenizer).__name__ == "FluxTokenizer"
    assert clip.cond_stage_model.clip_l.transformer.num_layers == 3     # the tiny config reached ComfyUI's class
    assert comfy.sd.detect_te_model is detect


def test_flux_text_encoders_give_flux_conds(flux_files, flux_conds):
    assert flux_conds["cond"].shape[0] == 1 and flux_conds["cond"].shape[2] == 4096
    assert flux_conds["pooled_output"].shape == (1, 768)
    other = encode(flux_files, "flux", "a blue sphere")
    assert not torch.allclose(other["cond"], flux_conds["cond"])


def test_sdxl_text_encoders_fit_the_unet(sdxl_model, sdxl_conds):
    unet = sdxl_model.model.model_config.unet_config
    assert sdxl_conds["cond"].shape == (1, 77, unet["context_dim"])
    adm = sdxl_model.model.encode_adm(pooled_output=sdxl_conds["pooled_output"], width=64, height=64)
    assert adm.shape == (1, unet["adm_in_channels"])


@pytest.mark.parametrize("arch, channels", [("flux", 16), ("sdxl", 4)])
def test_vae_encodes_to_the_latent_channels(request, arch, channels):
    files = request.getfixturevalue(f"{arch}_files")
    vae = loading.load_vae(files.vae, arch=arch)
    assert vae.encode(torch.rand(2, 64, 48, 3)).shape == (2, channels, 8, 6)


# --- forward passes ------------------------------------------------------------------------------
def test_tiny_flux_forward_depends_on_its_inputs(flux_model, flux_conds):
    model = flux_model.model.diffusion_model
    x = torch.randn(1, 16, 16, 16, generator=torch.Generator().manual_seed(0))

    def run(latent, t=0.5):
        with torch.no_grad():
            return model(latent, torch.tensor([t]), flux_conds["cond"], y=flux_conds["pooled_output"],
                         guidance=torch.tensor([3.5]))
    out = run(x)
    assert out.shape == x.shape and torch.isfinite(out).all()
    assert not torch.allclose(out, run(x * 0.5)) and not torch.allclose(out, run(x, t=0.9))


def test_tiny_sdxl_forward_through_apply_model(sdxl_model, sdxl_conds):
    model = sdxl_model.model
    adm = model.encode_adm(pooled_output=sdxl_conds["pooled_output"], width=128, height=128)
    x = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model.apply_model(x, torch.tensor([1.0]), c_crossattn=sdxl_conds["cond"], y=adm)
        eps = model.diffusion_model(x, torch.tensor([500.0]), context=sdxl_conds["cond"], y=adm)
    assert out.shape == x.shape and torch.isfinite(out).all()
    assert eps.abs().sum() > 0


# --- the writer ------------------------------------------------------------------------------------
def test_writer_streams_a_valid_deterministic_safetensors_file(tmp_path):
    from safetensors.torch import load_file
    module = build_sdxl_unet("tiny")
    n = tiny.write_safetensors(module, tmp_path / "a.safetensors", torch.bfloat16, 3, {"k": "v"})
    tiny.write_safetensors(module, tmp_path / "b.safetensors", torch.float32, 3, {})
    a, b = load_file(tmp_path / "a.safetensors"), load_file(tmp_path / "b.safetensors")
    assert sum(t.numel() for t in a.values()) == n == sum(p.numel() for p in module.parameters())
    assert all(t.dtype == torch.bfloat16 for t in a.values())
    assert torch.equal(a["input_blocks.0.0.weight"], b["input_blocks.0.0.weight"].bfloat16())
    assert 0.015 < b["out.2.weight"].std() < 0.025 and b["out.0.weight"].eq(1).all()  # conv; GroupNorm
    assert b["input_blocks.0.0.bias"].eq(0).all()


# --- errors a user can act on -------------------------------------------------------------------
def test_missing_and_unreadable_files_name_the_file(tmp_path, flux_files):
    missing = tmp_path / "nope.safetensors"
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\xff" * 64)
    for path in (missing, garbage):
        for load in (lambda p: loading.load_diffusion_model(p, torch.float32), loading.load_vae,
                     loading.detect_architecture,
                     lambda p: loading.load_text_encoders([p, flux_files.text_encoders[1]], "flux", None)):
            with pytest.raises(ModelError, match=path.name):
                load(path)


def test_wrong_files_say_what_was_expected(flux_files, sdxl_files):
    with pytest.raises(ModelError, match="diffusion model PipeTrain trains"):
        loading.load_diffusion_model(flux_files.vae, torch.float32)
    with pytest.raises(ModelError, match="expected a sdxl diffusion model"):
        loading.load_diffusion_model(flux_files.diffusion_model, torch.float32, arch="sdxl")
    with pytest.raises(ModelError, match="CLIP-L \\+ CLIP-G"):
        loading.load_text_encoders(flux_files.text_encoders, "sdxl", torch.float32)
    with pytest.raises(ModelError, match="CLIP-L \\+ T5-XXL"):
        loading.load_text_encoders([flux_files.vae, flux_files.vae], "flux", torch.float32)
    with pytest.raises(ModelError, match="cannot be mixed"):
        loading.load_text_encoders([flux_files.text_encoders[0], flux_files.vae], "flux", torch.float32)
    with pytest.raises(ModelError, match="16 latent channels"):
        loading.load_vae(sdxl_files.vae, arch="flux")


def test_a_diffusion_model_of_another_architecture_is_refused_from_its_header(micro_flux_files):
    """``type = "chroma"`` on a Flux file used to surface after the whole cache was written (as an
    AttributeError); the header tells at once. Types sharing ComfyUI's model class share files."""
    from pipetrain.backend.errors import ModelError
    from pipetrain.backend.models.loading import check_architecture

    check_architecture(micro_flux_files.diffusion_model, "flux")
    check_architecture(micro_flux_files.diffusion_model, "flux_kontext")
    with pytest.raises(ModelError, match="model.type = 'chroma', but this file is a Flux diffusion model; "
                                         "set model.type = 'flux'"):
        check_architecture(micro_flux_files.diffusion_model, "chroma")
    with pytest.raises(ModelError, match="does not recognise this file as a diffusion model"):
        check_architecture(micro_flux_files.vae, "flux")


def test_the_shared_cache_stores_identical_vae_and_text_encoder_files_once(model_files):
    """Flux and Chroma take the same T5 and VAE: one file on disk, linked into both folders (CI's disk is
    shared and the cache of every architecture is gigabytes)."""
    import os
    flux, chroma = model_files("flux", "micro"), model_files("chroma")
    assert os.path.samefile(flux.vae, chroma.vae)
    assert os.path.samefile(flux.text_encoders[1], chroma.text_encoders[0])   # t5xxl
    assert not list(flux.vae.parent.glob(".*"))                                # no temporary files left


class _Planted:
    """A pickle that would call a function when loaded unrestricted."""

    def __reduce__(self):
        return (print, ("planted code ran",))


def test_a_pickled_model_file_is_refused_without_quoting_it_or_advising_an_unrestricted_load(tmp_path):
    """torch's restricted unpickler refuses the file, and its message names the pickle's globals and tells the
    reader to load it with weights_only=False (which runs them): the refusal names the file alone."""
    path = tmp_path / "model.ckpt"
    torch.save({"weight": torch.zeros(2), "x": _Planted()}, path)
    for read in (loading.read_header, loading._load_state_dict):
        with pytest.raises(ModelError) as e:
            read(path)
        text = str(e.value)
        assert text.startswith(f"{path}: holds more than tensors and plain values"), text
        assert "weights_only" not in text and "print" not in text and "_Planted" not in text, text
