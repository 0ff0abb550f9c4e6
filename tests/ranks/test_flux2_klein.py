"""Flux 2 Klein (issue #37): ComfyUI's Flux2 class with a Qwen3 text encoder, which ComfyUI loads from 0.9.2 on.

On the pinned ComfyUI 0.3.75 the type is refused by name with the ComfyUI it needs, whether a config names it
(``flux2_klein``) or names diffusion-pipe's ``flux2`` with a Klein file. On ComfyUI 0.33.0 (the machine's ComfyUI
cache; skipped where absent), each in a child process importing it: ComfyUI's detection tells the published Klein
4B and 9B layouts and their Qwen3 text encoders; the tiny files load through ComfyUI (Klein's chat template, the
layers 9 / 18 / 27 of Qwen3); the parity check passes in float64 against ComfyUI's eager paths and in float32
against its fused kernels, with LoRA and gradients; diffusion-pipe's own Klein config goes through check-config and
trains on 2 ranks as a 2-stage pipeline, and each epoch LoRA loads in 0.33.0's LoraLoaderModelOnly with every key
applied, reproducing the training side."""
import json
import struct
from pathlib import Path

import pytest
from comfyui_copies import (check_config_on, check_two_epoch_run_on, child_json, doctor, newer_comfyui,
                            ranks_import, tiny_files_code)
from conftest import train

from pipetrain.backend.errors import ConfigError
from pipetrain.backend.preflight import load_run
from pipetrain.backend.host.runtime import PINNED_VERSION

NEWER = "0.33.0"


def _comfyui() -> Path:
    return newer_comfyui(NEWER)


def _klein_header_file(path: Path, text_width: int = 7680) -> Path:
    """A safetensors file with Flux 2's shared-modulation layout and a Qwen3-wide text input (Klein 4B's 7680):
    the header is all that decides the model type; the tensors are zeros."""
    shapes = {"double_stream_modulation_img.lin.weight": (6 * 16, 16), "txt_in.weight": (16, text_width)}
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 4 * shape[0] * shape[1]
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    return path


def _run_config(tmp_path: Path, model: str, diffusion_model: Path, text_encoder: str = "qwen_3_4b.safetensors"):
    """diffusion-pipe's Klein example (docs/supported_models.md) with paths here."""
    (tmp_path / "images").mkdir(exist_ok=True)
    (tmp_path / "dataset.toml").write_text('[[directory]]\npath = "images"\n')
    (tmp_path / "run.toml").write_text(
        f'output_dir = "out"\ndataset = "dataset.toml"\n[model]\ntype = "{model}"\n'
        f'diffusion_model = "{diffusion_model}"\nvae = "flux2-vae.safetensors"\n'
        f'text_encoders = [{{path = "{text_encoder}", type = "flux2"}}]\ndtype = "bfloat16"\n'
        "timestep_sample_method = 'logit_normal'\nshift = 3\n")
    return tmp_path / "run.toml"


# --- the pinned ComfyUI: refused by name --------------------------------------------------------------------------
@pytest.mark.parametrize("declared", ["flux2_klein", "flux2"])
def test_klein_is_refused_on_the_pinned_comfyui_naming_the_comfyui_it_needs(tmp_path, declared):
    """``flux2_klein``, or diffusion-pipe's ``flux2`` with a Klein file (its header tells), fails validation on
    0.3.75, whose Flux2 class builds the network but loads no Klein text encoder."""
    klein = _klein_header_file(tmp_path / "flux-2-klein-base-4b.safetensors")
    with pytest.raises(ConfigError) as err:
        load_run(_run_config(tmp_path, declared, klein))
    message = str(err.value)
    assert "model.type" in message and "'flux2_klein' (Flux 2 Klein)" in message, message
    assert "needs ComfyUI 0.9.2 or newer" in message and f"this ComfyUI is {PINNED_VERSION}" in message, message


def test_flux2_with_a_dev_file_stays_flux2(tmp_path):
    """The file decides only between Flux 2's variants: a Mistral-wide text input is Flux 2 dev, as before."""
    from pipetrain.backend.config import load_run_config

    dev = _klein_header_file(tmp_path / "flux2-dev.safetensors", text_width=15360)
    assert load_run_config(_run_config(tmp_path, "flux2", dev)).model.type == "flux2"


def test_the_parity_check_on_the_pinned_comfyui_refuses_klein_by_name(tmp_path, monkeypatch):
    from pipetrain.backend.parity import check as parity

    monkeypatch.setenv("PIPETRAIN_PARITY_CACHE", str(tmp_path))
    r = parity.check_model_type("flux2_klein")
    assert r.verdict == "lacks" and r.needs_comfyui == "0.9.2" and r.comfyui_version == PINNED_VERSION
    assert "needs ComfyUI 0.9.2 or newer" in r.message() and "stops before caching" in r.message()


# --- ComfyUI 0.33.0 -------------------------------------------------------------------------------------------------
_DETECTION = """
import json, torch
from pipetrain.backend.host.runtime import ensure_comfyui
ensure_comfyui()
import comfy.model_detection as md, comfy.sd, comfy.supported_models as sm
from pipetrain.backend.models import loading, tiny
from pipetrain.backend.models.flux2_klein import FLUX2_KLEIN_4B, FLUX2_KLEIN_9B, Flux2KleinAdapter
from pipetrain.backend.models.registry import arch_spec
from pipetrain.backend.models.te_loading import _real_te_kind
out = {}
def meta(module):
    return {k: torch.empty(s, device="meta") for k, s, _ in tiny.tensor_plan(module)}
spec = arch_spec("flux2_klein")
for name, config in (("4b", FLUX2_KLEIN_4B), ("9b", FLUX2_KLEIN_9B), ("dev", arch_spec("flux2").unet_config("full"))):
    sd = meta(spec.build_host(config))
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    detected = md.detect_unet_config(sd, "")
    out[name] = {"class": type(md.model_config_from_unet(sd, "")).__name__,
                 "config_agrees": all(detected[k] == v for k, v in config.items()),
                 "arch": loading.arch_from_state_dict_shapes(shapes),
                 "claims": Flux2KleinAdapter.claims_file(shapes, {}),
                 "parameters": sum(v.numel() for v in sd.values())}
for kind in ("qwen3_4b", "qwen3_8b"):
    te = meta(tiny.build_text_encoder(kind, tiny.text_encoder_config(kind, "full")))
    out[kind] = _real_te_kind({k: tuple(v.shape) for k, v in te.items()})
print(json.dumps(out))
"""


def test_comfyui_033_detects_klein_4b_and_9b_and_their_qwen3_text_encoders():
    got = child_json(_DETECTION, _comfyui())
    for name in ("4b", "9b"):
        assert got[name]["class"] == "Flux2" and got[name]["config_agrees"], got
        assert got[name]["arch"] == "flux2_klein" and got[name]["claims"], got
    assert got["dev"]["arch"] == "flux2" and not got["dev"]["claims"], got
    assert 3.5e9 < got["4b"]["parameters"] < 4.5e9 and 8.5e9 < got["9b"]["parameters"] < 9.5e9, got
    assert got["qwen3_4b"] == "qwen3_4b" and got["qwen3_8b"] == "qwen3_8b", got


_TINY = tiny_files_code("flux2_klein") + """
if sys.argv[1:] == ["load"]:
    patcher = loading.load_diffusion_model(files.diffusion_model, torch.float32)
    params = patcher.model.diffusion_model.params
    out["model"] = [type(patcher.model).__name__, params.context_in_dim, params.guidance_embed]
    out["arch"] = loading.detect_architecture(files.diffusion_model)
    clip = loading.load_text_encoders(files.text_encoders, "flux2_klein", torch.float32)
    tokens = clip.tokenize("a red cube")
    ids = [i for i, *_ in tokens["qwen3_8b"][0]]
    out["template"] = clip.tokenizer.qwen3_8b.tokenizer.decode([i for i in ids if i != 151643])
    cond = clip.encode_from_tokens(tokens, return_dict=True)["cond"]
    other = clip.encode_from_tokens(clip.tokenize("a blue sphere"), return_dict=True)["cond"]
    out["cond"] = list(cond.shape)
    out["captions_differ"] = not torch.allclose(cond, other)
    vae = loading.load_vae(files.vae, arch="flux2_klein")
    out["latent"] = list(vae.encode(torch.rand(1, 64, 96, 3)).shape)
print(json.dumps(out))
"""


def _tiny_files(comfyui: Path) -> dict:
    """The tiny Klein files, written once per machine by a process importing ``comfyui`` (the pinned one lacks
    Qwen3-8B)."""
    return child_json(_TINY, comfyui)["files"]


def test_tiny_klein_files_load_through_comfyui_033():
    """The network from its metadata; Qwen3-8B through ComfyUI's Klein tokenizer (its chat template) and encoder
    (layers 9, 18, 27 side by side: 3 x 64), padded to 512 tokens; Flux 2's VAE (16x, 128 channels)."""
    got = child_json(_TINY, _comfyui(), "load")
    assert got["model"] == ["Flux2", 192, False] and got["arch"] == "flux2_klein", got
    assert got["template"].startswith("<|im_start|>user\na red cube<|im_end|>"), got
    assert got["cond"] == [1, 512, 192] and got["captions_differ"], got
    assert got["latent"] == [1, 128, 4, 6], got


def test_klein_passes_the_parity_check_on_comfyui_033(tmp_path):
    # forked from the warm server of the ComfyUI the file's other children use (a fresh memo: the check itself runs)
    (r,) = doctor(_comfyui(), "flux2_klein", warm=True, PIPETRAIN_PARITY_CACHE=str(tmp_path))["parity"]
    assert r["comfyui_version"] == NEWER and r["verdict"] == "passes", r
    assert r["dtype"] == "float64" and r["max_difference"] <= 1e-12 * r["scale"], r   # ComfyUI's eager paths
    assert r["kernel_difference"] is not None and r["kernel_difference"] <= 1e-5 * r["scale"], r   # fused kernels
    assert r["lora_keys"] == 20 and r["lora_difference"] <= 1e-12 * r["scale"], r


@pytest.mark.slow
def test_diffusion_pipes_klein_config_trains_two_stages_on_comfyui_033_to_loras_its_loader_applies(make_run,
                                                                                                  monkeypatch,
                                                                                                  tmp_path):
    comfyui = _comfyui()
    files = _tiny_files(comfyui)
    ranks_import(comfyui, monkeypatch, tmp_path / "memo")

    class Files:   # diffusion-pipe's own config: type 'flux2', the text encoder as a table of type 'flux2'
        diffusion_model, vae, text_encoders = files["diffusion_model"], files["vae"], files["text_encoders"]
    config = make_run(Files, images=8, stages=2, epochs=2, micro_batch_size_per_gpu=2, optimizer={"lr": 2e-2},
                      model={"type": "flux2", "shift": 3, "timestep_sample_method": "logit_normal",
                             "text_encoders": [{"path": files["text_encoders"][0], "type": "flux2"}]})
    checked = check_config_on(comfyui, config)
    assert ("Loads: trains model type 'flux2_klein' (diffusion-pipe's 'flux2' with a Flux 2 Klein file"
            in checked), checked
    assert "a Qwen3-8B text encoder file" in checked, checked

    run = train(config, ranks=2)
    # 0.33.0's LoraLoaderModelOnly patches all 20 adapted linears
    check_two_epoch_run_on(comfyui, NEWER, run, config, "flux2_klein", keys=20)
    assert run.events("engine")[0]["stage_bounds"] == [0, 3, 7]   # input + 2 double | join + 2 single + output
