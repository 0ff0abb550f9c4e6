"""Base weights in fp8 on the micro Flux: ``diffusion_model_dtype = "float8"`` and ComfyUI's fp8_scaled files
(a ``scaled_fp8`` marker, per-linear ``scale_weight``) load with frozen float8 linears that ComfyUI's
manual-cast ops compute in the input dtype; LoRA on top trains (gradients close to the float32 model's),
and a full run's epoch LoRA loads in ComfyUI (``verify.check_lora``)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import train
from safetensors.torch import load_file, save_file

from pipetrain.backend.adapters import injection
from pipetrain.backend.config import ModelConfig

F8 = torch.float8_e4m3fn


def _model_cfg(files, weight_dtype=None, diffusion_model=None) -> ModelConfig:
    return ModelConfig(type="flux", diffusion_model=str(diffusion_model or files.diffusion_model), vae=str(files.vae),
                       text_encoders=[str(p) for p in files.text_encoders], dtype="float32",
                       diffusion_model_dtype=weight_dtype)


def write_fp8_scaled(src, dst) -> None:
    """ComfyUI's fp8_scaled layout: every linear weight as float8_e4m3fn / scale_weight, a float32 scalar."""
    from safetensors import safe_open
    with safe_open(str(src), framework="pt") as f:
        metadata = f.metadata()
    sd = load_file(str(src))
    out = {}
    for k, v in sd.items():
        if k.endswith(".weight") and v.ndim == 2:
            scale = v.float().abs().max() / 448.0
            out[k] = (v.float() / scale).to(F8)
            out[k[:-len("weight")] + "scale_weight"] = scale.reshape(())
        else:
            out[k] = v
    out["scaled_fp8"] = torch.zeros(2, dtype=F8)
    save_file(out, str(dst), metadata=metadata)


def _loss_and_grads(files, weight_dtype=None, diffusion_model=None):
    """One LoRA forward/backward through the pipeline layers on a fixed probe batch."""
    from pipetrain.backend.models.registry import adapter_class
    from pipetrain.backend.host.runtime import ensure_comfyui
    from pipetrain.backend.parity.verify import probe_inputs

    ensure_comfyui()
    adapter = adapter_class("flux")(_model_cfg(files, weight_dtype, diffusion_model))
    adapter.load_diffusion_model()
    dm = adapter.diffusion_model
    injection.inject(dm, injection.AdapterSpec(rank=4, alpha=4.0, seed=1), adapter.lora_block_prefixes)
    g = torch.Generator().manual_seed(2)
    for m in injection.adapted_modules(dm):   # B starts at 0: give it values so A gets gradients too
        m.lora_B.weight.data.normal_(0, 0.05, generator=g)
    x0, noise, t, text = probe_inputs(adapter)
    h = (x0, noise, t, *text)
    for layer in adapter.to_layers():
        h = layer(h)
    loss = adapter.loss(h, (x0, noise, t))
    loss.backward()
    linears = [m for m in injection.adapted_modules(dm)]
    grads = torch.cat([p.grad.flatten() for p in injection.trainable_parameters(dm)])
    return float(loss.detach()), grads, linears, dm


@pytest.fixture(scope="module")
def fp32_reference(micro_flux_files):
    loss, grads, _, _ = _loss_and_grads(micro_flux_files)
    return loss, grads


@pytest.mark.parametrize("kind", ["float8", "fp8_scaled"])
def test_fp8_base_weights_stay_frozen_float8_and_lora_trains(micro_flux_files, fp32_reference, kind, tmp_path):
    if kind == "fp8_scaled":
        path = tmp_path / "flux_micro_fp8_scaled.safetensors"
        write_fp8_scaled(micro_flux_files.diffusion_model, path)
        loss, grads, linears, dm = _loss_and_grads(micro_flux_files, diffusion_model=path)
        assert all(float(m.scale_weight) != 1.0 for m in linears)     # the file's scales were loaded
    else:
        loss, grads, linears, dm = _loss_and_grads(micro_flux_files, "float8")
    assert linears and {m.weight.dtype for m in linears} == {F8}
    assert not any(m.weight.requires_grad or m.weight.grad is not None for m in linears)
    assert all(p.dtype == torch.float32 for p in injection.trainable_parameters(dm))
    ref_loss, ref_grads = fp32_reference
    assert loss != ref_loss                                        # really computed from fp8 weights ...
    assert loss == pytest.approx(ref_loss, rel=2e-2)               # ... and close to the float32 model
    cos = torch.nn.functional.cosine_similarity(grads, ref_grads, dim=0)
    assert cos > 0.98, f"LoRA gradient direction differs from the float32 model's (cosine {cos:.4f})"


@pytest.mark.slow
def test_fp8_run_trains_and_its_lora_loads_in_comfyui(micro_flux_files, make_run):
    from pipetrain.backend.config import load_run_config
    from pipetrain.backend.parity.verify import check_lora

    config = make_run(micro_flux_files, images=2, name="fp8", stages=1, epochs=1, checkpoint_every_n_epochs=None,
                      model={"diffusion_model_dtype": "float8"})
    run = train(config, ranks=1)
    assert run.returncode == 0, run.output[-4000:]
    losses = run.losses()
    assert len(losses) == 2 and all(0 < x < 10 for x in losses)
    cfg = load_run_config(config)
    check = check_lora(cfg, run.loras()[-1])
    assert check.keys_loaded > 0 and check.lora_effect > 0
    # ComfyUI merges the LoRA into the fp8 weights (rounded to fp8); the training side adds it unrounded
    assert check.comfy_vs_training < 0.05 * check.scale + 10 * check.lora_effect
    assert dataclasses.asdict(cfg.model)["diffusion_model_dtype"] == "float8"
