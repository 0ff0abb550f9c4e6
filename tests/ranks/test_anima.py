"""Anima (issue #37): Cosmos-Predict2's network behind an LLM adapter reading Qwen3-0.6B, in ComfyUI from after 0.8.0.

On the pinned ComfyUI 0.3.75 the parity verdict refuses the type by name (its ``comfy.supported_models`` has no
Anima). On ComfyUI 0.33.0 (the machine's ComfyUI cache; skipped where absent), each in a child process importing
it: ComfyUI's detection tells the published Anima layout and its Qwen3-0.6B text encoder; the tiny files load
through ComfyUI (its Anima encoder: Qwen3 states plus T5 ids and weights); the parity check passes in float64
against ComfyUI's eager paths and in float32 against its fused kernels, with LoRA; a batch of captions of different
lengths gives each sample ComfyUI's output for that caption alone; diffusion-pipe's Anima config (its file keys)
goes through check-config and trains on 2 ranks as a 2-stage pipeline, and each epoch LoRA loads in 0.33.0's
LoraLoaderModelOnly with every key applied, reproducing the training side."""
import tomllib
from pathlib import Path

import pytest
import tomli_w
from comfyui_copies import (check_config_on, check_two_epoch_run_on, child_json, doctor, newer_comfyui,
                            ranks_import, tiny_files_code)
from conftest import train

from pipetrain.backend.host.runtime import PINNED_VERSION

NEWER = "0.33.0"


def _comfyui() -> Path:
    return newer_comfyui(NEWER)


# --- the pinned ComfyUI: refused by name --------------------------------------------------------------------------
def test_the_parity_check_on_the_pinned_comfyui_refuses_anima_by_name(tmp_path, monkeypatch):
    from pipetrain.backend.parity import check as parity

    monkeypatch.setenv("PIPETRAIN_PARITY_CACHE", str(tmp_path))
    r = parity.check_model_type("anima")
    assert r.verdict == "lacks" and r.comfyui_version == PINNED_VERSION, r
    assert "comfy.supported_models.Anima" in r.message() and "later ComfyUI" in r.message(), r.message()


# --- ComfyUI 0.33.0 -------------------------------------------------------------------------------------------------
_DETECTION = """
import json, torch
from pipetrain.backend.host.runtime import ensure_comfyui
ensure_comfyui()
import comfy.model_detection as md
from pipetrain.backend.models import loading, tiny
from pipetrain.backend.models.registry import arch_spec
from pipetrain.backend.models.te_loading import _real_te_kind
def meta(module):
    return {k: torch.empty(s, device="meta") for k, s, _ in tiny.tensor_plan(module)}
out = {}
for arch in ("anima", "cosmos_predict2"):
    config = arch_spec(arch).unet_config("full")
    sd = meta(arch_spec(arch).build_host(config))
    detected = md.detect_unet_config(sd, "")
    out[arch] = {"class": type(md.model_config_from_unet(sd, "")).__name__,
                 "config_agrees": all(detected[k] == v for k, v in config.items()),
                 "arch": loading.arch_from_state_dict_shapes({k: tuple(v.shape) for k, v in sd.items()}),
                 "parameters": sum(v.numel() for v in sd.values())}
te = meta(tiny.build_text_encoder("qwen3_06b", tiny.text_encoder_config("qwen3_06b", "full")))
out["qwen3_06b"] = _real_te_kind({k: tuple(v.shape) for k, v in te.items()})
print(json.dumps(out))
"""


def test_comfyui_033_detects_anima_and_its_qwen3_text_encoder():
    got = child_json(_DETECTION, _comfyui())
    assert got["anima"]["class"] == "Anima" and got["anima"]["config_agrees"], got
    assert got["anima"]["arch"] == "anima" and got["cosmos_predict2"]["arch"] == "cosmos_predict2", got
    # Cosmos-Predict2 2B plus the LLM adapter (embeddings of T5's 32128 ids and six 1024-wide blocks)
    added = got["anima"]["parameters"] - got["cosmos_predict2"]["parameters"]
    assert 1.0e8 < added < 1.6e8 and 1.9e9 < got["cosmos_predict2"]["parameters"] < 2.2e9, got
    assert got["qwen3_06b"] == "qwen3_06b", got


_TINY = tiny_files_code("anima") + """
if sys.argv[1:] == ["load"]:
    patcher = loading.load_diffusion_model(files.diffusion_model, torch.float32)
    out["model"] = type(patcher.model).__name__
    out["arch"] = loading.detect_architecture(files.diffusion_model)
    clip = loading.load_text_encoders(files.text_encoders, "anima", torch.float32)
    enc = clip.encode_from_tokens(clip.tokenize("a red cube"), return_dict=True)
    other = clip.encode_from_tokens(clip.tokenize("a blue sphere"), return_dict=True)
    out["cond"] = list(enc["cond"].shape)
    out["ids"] = enc["t5xxl_ids"].tolist()
    out["weights"] = enc["t5xxl_weights"].tolist()
    out["captions_differ"] = enc["cond"].shape != other["cond"].shape or not torch.allclose(enc["cond"], other["cond"])
    vae = loading.load_vae(files.vae, arch="anima")
    out["latent"] = list(vae.encode(torch.rand(1, 64, 96, 3)).shape)
print(json.dumps(out))
"""


def _tiny_files(comfyui: Path) -> dict:
    """The tiny Anima files, written once per machine by a process importing ``comfyui`` (the pinned one lacks
    Anima)."""
    return child_json(_TINY, comfyui)["files"]


def test_tiny_anima_files_load_through_comfyui_033():
    """The network from its metadata; Qwen3-0.6B through ComfyUI's Anima encoder (3 tokens of 64, no padding) with
    T5's ids of the caption (its end token 1) and weights 1; Wan 2.1's VAE (8x, 16 channels, one frame)."""
    got = child_json(_TINY, _comfyui(), "load")
    assert got["model"] == "Anima" and got["arch"] == "anima", got
    assert got["cond"] == [1, 3, 64] and got["captions_differ"], got
    assert got["ids"][-1] == 1 and len(got["ids"]) == 6 and got["weights"] == [1.0] * 6, got
    assert got["latent"] == [1, 16, 1, 8, 12], got


def test_anima_passes_the_parity_check_on_comfyui_033(tmp_path):
    # forked from the warm server of the ComfyUI the file's other children use (a fresh memo: the check itself runs)
    (r,) = doctor(_comfyui(), "anima", warm=True, PIPETRAIN_PARITY_CACHE=str(tmp_path))["parity"]
    assert r["comfyui_version"] == NEWER and r["verdict"] == "passes", r
    assert r["dtype"] == "float64" and r["max_difference"] <= 1e-12 * r["scale"], r   # ComfyUI's eager paths
    assert r["kernel_difference"] is not None and r["kernel_difference"] <= 1e-5 * r["scale"], r   # fused kernels
    assert r["lora_keys"] == 32 and r["lora_difference"] <= 1e-12 * r["scale"], r


_BATCH = """
import json, torch
from pipetrain.backend.host.runtime import ensure_comfyui
ensure_comfyui()
from pipetrain.backend.parity.check import _run_layers, _small_adapter
from pipetrain.backend.host.runtime import comfy_training_paths
adapter = _small_adapter("anima")
g = torch.Generator().manual_seed(3)
width = adapter.diffusion_model.llm_adapter.blocks[0].cross_attn.context_dim
captions = [{"qwen3": torch.randn(n, width, generator=g, dtype=torch.float64),
             "t5_ids": torch.randint(0, 32128, (m,), generator=g),
             "t5_weights": 0.5 + torch.rand(m, generator=g, dtype=torch.float64)} for n, m in ((5, 9), (11, 4))]
x0 = torch.randn(2, 16, 1, 8, 8, generator=g, dtype=torch.float64)
noise = torch.randn(x0.shape, generator=g, dtype=torch.float64)
t = torch.tensor([0.3, 0.7], dtype=torch.float64)
batch = _run_layers(adapter, (x0, noise, t, *adapter.collate_text(captions)))
alone, padded = [], []
for i, c in enumerate(captions):
    x_t = adapter.objective().noisy(x0[i:i + 1], noise[i:i + 1], t[i:i + 1])
    with torch.no_grad(), comfy_training_paths(True):   # ComfyUI's eager paths: its fused kernels refuse float64
        alone.append(adapter.reference_forward(x_t, t[i:i + 1], adapter.collate_text([c])))
        # the same caption zero-padded to the batch's lengths, as a plain stack would give it
        stacked = adapter.collate_text(captions)
        padded.append(adapter.reference_forward(x_t, t[i:i + 1], [x[i:i + 1] for x in stacked]))
alone, padded = torch.cat(alone), torch.cat(padded)
print(json.dumps({"difference": (batch - alone).abs().max().item(), "scale": alone.abs().max().item(),
                  "padding_changes": (padded - alone).abs().max().item()}))
"""


def test_a_batch_of_captions_of_different_lengths_trains_each_as_comfyui_encodes_it_alone():
    """The LLM adapter attends unmasked: padding a caption to the batch's longest would change its context, so the
    layers run the adapter on each sample's own lengths and match ComfyUI's forward of each sample alone."""
    got = child_json(_BATCH, _comfyui())
    assert got["difference"] <= 1e-12 * got["scale"], got
    assert got["padding_changes"] > 1e-6 * got["scale"], got   # what a padded batch would have trained


def _diffusion_pipe_keys(config: Path, files: dict) -> None:
    """The run's [model] table as diffusion-pipe's Anima example writes it: its single-file keys."""
    run = tomllib.loads(config.read_text())
    model = {k: v for k, v in run["model"].items() if k not in ("diffusion_model", "vae", "text_encoders")}
    run["model"] = {**model, "transformer_path": files["diffusion_model"], "vae_path": files["vae"],
                    "llm_path": files["text_encoders"][0]}
    config.write_text(tomli_w.dumps(run))


@pytest.mark.slow
def test_diffusion_pipes_anima_config_trains_two_stages_on_comfyui_033_to_loras_its_loader_applies(make_run,
                                                                                                  monkeypatch,
                                                                                                  tmp_path):
    comfyui = _comfyui()
    files = _tiny_files(comfyui)
    ranks_import(comfyui, monkeypatch, tmp_path / "memo")

    class Files:
        diffusion_model, vae, text_encoders = files["diffusion_model"], files["vae"], files["text_encoders"]
    # 4 pictures: a batch of 2 in each bucket shape, 2 steps an epoch (what is asserted, two epoch LoRAs that ComfyUI
    # applies, does not grow with the number of steps)
    config = make_run(Files, images=4, stages=2, epochs=2, micro_batch_size_per_gpu=2, optimizer={"lr": 2e-2},
                      model={"type": "anima", "timestep_sample_method": "logit_normal"})
    _diffusion_pipe_keys(config, files)
    checked = check_config_on(comfyui, config)
    assert "Loads: trains model type 'anima'." in checked, checked
    assert "a Qwen3-0.6B text encoder file" in checked, checked

    run = train(config, ranks=2)
    check_two_epoch_run_on(comfyui, NEWER, run, config, "anima", keys=32)   # every adapted linear patched
    assert run.events("engine")[0]["stage_bounds"] == [0, 2, 4]   # input + block | block + output
