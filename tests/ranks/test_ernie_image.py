"""Ernie-Image (issue #37): ComfyUI's ErnieImageModel (from ComfyUI 0.19.0) reading Ministral-3-3B, Flux 2's latents.

Below 0.19.0 the type fails validation naming the ComfyUI it needs. On ComfyUI 0.33.0 (the machine's ComfyUI cache;
skipped where absent) one child process importing it answers the single-process checks: ComfyUI's detection tells
the published Ernie-Image layout and its Ministral-3-3B text encoder; the tiny files load through ComfyUI (its Ernie
encoder: one caption's states, no padding); the parity check passes in float64 against ComfyUI's eager paths and in
float32 against its fused kernels, with LoRA; a batch of captions of different lengths gives each sample ComfyUI's
output for that caption alone. Then diffusion-pipe's Ernie-Image config goes through check-config and trains on 2
ranks as a 2-stage pipeline, and each epoch LoRA loads in 0.33.0's LoraLoaderModelOnly with every key applied,
reproducing the training side."""
import tomllib
from pathlib import Path

import pytest
import tomli_w
from comfyui_copies import check_config_on, check_two_epoch_run_on, child_json, newer_comfyui, ranks_import
from conftest import train

NEWER = "0.33.0"


def _comfyui() -> Path:
    return newer_comfyui(NEWER)


def test_ernie_image_is_refused_by_name_below_the_comfyui_that_has_it():
    from pipetrain.backend.models.registry import too_old_reason

    message = too_old_reason("ernie_image", "0.18.0")
    assert "'ernie_image' (Ernie-Image) needs ComfyUI 0.19.0 or newer" in message and "0.18.0" in message, message
    assert too_old_reason("ernie_image", NEWER) is None


# one child importing 0.33.0: detection, the tiny files, the parity check (a fresh memo: it runs) and a batch
_CHECKS = """
import json, torch
from pipetrain.backend.host.runtime import comfy_training_paths, ensure_comfyui
ensure_comfyui()
import comfy.model_detection as md
from pipetrain.backend.models import loading, tiny
from pipetrain.backend.models.registry import arch_spec
from pipetrain.backend.models.te_loading import _real_te_kind
from pipetrain.backend.parity.check import _run_layers, _small_adapter, check_model_type
out = {}

def meta(module):
    return {k: torch.empty(s, device="meta") for k, s, _ in tiny.tensor_plan(module)}
sd = meta(arch_spec("ernie_image").build_host(arch_spec("ernie_image").unet_config("full")))
out["detected"] = {"class": type(md.model_config_from_unet(sd, "")).__name__,
                   "arch": loading.arch_from_state_dict_shapes({k: tuple(v.shape) for k, v in sd.items()}),
                   "parameters": sum(v.numel() for v in sd.values())}
te = meta(tiny.build_text_encoder("ministral3_3b", tiny.text_encoder_config("ministral3_3b", "full")))
out["te_kind"] = _real_te_kind({k: tuple(v.shape) for k, v in te.items()})

files = tiny.cached_model_files("ernie_image")
out["files"] = {"diffusion_model": str(files.diffusion_model), "vae": str(files.vae),
                "text_encoders": [str(p) for p in files.text_encoders]}
patcher = loading.load_diffusion_model(files.diffusion_model, torch.float32)
out["model"] = [type(patcher.model).__name__, loading.detect_architecture(files.diffusion_model),
                patcher.model.model_sampling.multiplier]
clip = loading.load_text_encoders(files.text_encoders, "ernie_image", torch.float32)
cond = clip.encode_from_tokens(clip.tokenize("a red cube"), return_dict=True)["cond"]
other = clip.encode_from_tokens(clip.tokenize("a blue sphere"), return_dict=True)["cond"]
out["cond"], out["other"] = list(cond.shape), list(other.shape)
vae = loading.load_vae(files.vae, arch="ernie_image")
out["latent"] = list(vae.encode(torch.rand(1, 64, 96, 3)).shape)

out["parity"] = check_model_type("ernie_image").__dict__

adapter = _small_adapter("ernie_image")
g = torch.Generator().manual_seed(3)
width = adapter.diffusion_model.text_proj.in_features
captions = [{"ministral": torch.randn(n, width, generator=g, dtype=torch.float64)} for n in (5, 11)]
x0 = torch.randn(2, 128, 4, 6, generator=g, dtype=torch.float64)
noise = torch.randn(x0.shape, generator=g, dtype=torch.float64)
t = torch.tensor([0.3, 0.7], dtype=torch.float64)
batch = _run_layers(adapter, (x0, noise, t, *adapter.collate_text(captions)))
alone, padded = [], []
text, lengths = adapter.collate_text(captions)
for i, c in enumerate(captions):
    x_t = adapter.objective().noisy(x0[i:i + 1], noise[i:i + 1], t[i:i + 1])
    with torch.no_grad(), comfy_training_paths(True):   # ComfyUI's eager paths: its fused kernels refuse float64
        alone.append(adapter.reference_forward(x_t, t[i:i + 1], adapter.collate_text([c])))
        # the caption zero-padded to the batch's longest, as a plain stack would give it to ComfyUI
        padded.append(adapter.reference_forward(x_t, t[i:i + 1], [text[i:i + 1], lengths.max()[None]]))
alone, padded = torch.cat(alone), torch.cat(padded)
out["batch"] = {"difference": (batch - alone).abs().max().item(), "scale": alone.abs().max().item(),
                "padding_changes": (padded - alone).abs().max().item()}
print(json.dumps(out, default=str))
"""


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    comfyui = _comfyui()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PIPETRAIN_PARITY_CACHE", str(tmp_path_factory.mktemp("memo")))
        return child_json(_CHECKS, comfyui)


def test_comfyui_033_detects_ernie_image_and_its_ministral_text_encoder(checks):
    detected = checks["detected"]
    assert detected["class"] == "ErnieImage" and detected["arch"] == "ernie_image", checks
    assert 7.5e9 < detected["parameters"] < 8.5e9, detected   # 36 blocks of width 4096 (Ernie-Image's 8B)
    assert checks["te_kind"] == "ministral3_3b", checks


def test_tiny_ernie_image_files_load_through_comfyui_033(checks):
    """The network from its metadata, t x 1000 into it; Ministral-3-3B through ComfyUI's Ernie tokenizer and encoder
    (<s> and one token a byte, no padding: 11 and 14 tokens of 64); Flux 2's VAE (16x, 128 channels)."""
    assert checks["model"] == ["ErnieImage", "ernie_image", 1000.0], checks
    assert checks["cond"] == [1, 11, 64] and checks["other"] == [1, 14, 64], checks
    assert checks["latent"] == [1, 128, 4, 6], checks


def test_ernie_image_passes_the_parity_check_on_comfyui_033(checks):
    r = checks["parity"]
    assert r["comfyui_version"] == NEWER and r["verdict"] == "passes", r
    assert r["dtype"] == "float64" and r["max_difference"] <= 1e-12 * r["scale"], r   # ComfyUI's eager paths
    assert r["kernel_difference"] is not None and r["kernel_difference"] <= 1e-5 * r["scale"], r   # fused kernels
    # 2 blocks x (q, k, v, out, and the MLP's gate, up and down projections)
    assert r["lora_keys"] == 14 and r["lora_difference"] <= 1e-12 * r["scale"], r


def test_a_batch_of_captions_of_different_lengths_trains_each_as_comfyui_encodes_it_alone(checks):
    """ComfyUI attends over a caption unmasked and puts the image after it on RoPE's first axis: the layers mask each
    sample's padding and place its image at its own caption length, matching ComfyUI's forward of each alone."""
    got = checks["batch"]
    assert got["difference"] <= 1e-12 * got["scale"], got
    assert got["padding_changes"] > 1e-6 * got["scale"], got   # what a padded batch would have trained


def _diffusion_pipe_keys(config: Path, text_encoder: str) -> None:
    """The run's [model] table as diffusion-pipe's ComfyUI models write it: the text encoder a table of type
    'flux2' (diffusion-pipe's supported-models table for Ernie-Image), no shift."""
    run = tomllib.loads(config.read_text())
    run["model"]["text_encoders"] = [{"path": text_encoder, "type": "flux2"}]
    config.write_text(tomli_w.dumps(run))


@pytest.mark.slow
def test_diffusion_pipes_ernie_image_config_trains_two_stages_on_comfyui_033_to_loras_its_loader_applies(
        checks, make_run, monkeypatch, tmp_path):
    comfyui = _comfyui()
    files = checks["files"]
    ranks_import(comfyui, monkeypatch, tmp_path / "memo")

    class Files:
        diffusion_model, vae, text_encoders = files["diffusion_model"], files["vae"], files["text_encoders"]
    # 4 pictures: a batch of 2 in each bucket shape, 2 steps an epoch (what is asserted, two epoch LoRAs that ComfyUI
    # applies, does not grow with the number of steps). The tiny file's timestep vector is small (weights of std
    # 0.02), so are the blocks' gates and with them the LoRA's effect: AdamW's first steps move each weight by about
    # lr, and 0.5 takes the effect well past MIN_EFFECT (2e-2 left it at 1e-4)
    config = make_run(Files, images=4, stages=2, epochs=2, micro_batch_size_per_gpu=2, optimizer={"lr": 0.5},
                      model={"type": "ernie_image", "timestep_sample_method": "logit_normal"})
    _diffusion_pipe_keys(config, files["text_encoders"][0])
    checked = check_config_on(comfyui, config)
    assert "Loads: trains model type 'ernie_image'." in checked, checked
    assert "a Ministral-3-3B text encoder file" in checked, checked
    assert "a constant shift of 3 ('ernie_image' trains as ComfyUI samples it" in checked, checked

    run = train(config, ranks=2)
    check_two_epoch_run_on(comfyui, NEWER, run, config, "ernie_image", keys=14)   # every adapted linear patched
    assert run.events("engine")[0]["stage_bounds"] == [0, 2, 4]   # input + block | block + output
