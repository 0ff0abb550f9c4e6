"""``[model] merge_adapters``: LoRAs baked into the base weights before training, exactly as ComfyUI's
LoraLoaderModelOnly patches them; a LoRA for another model is refused naming the file."""
import pytest
import torch
from safetensors.torch import save_file

from pipetrain.backend.adapters import injection
from pipetrain.backend.config import ModelConfig
from pipetrain.backend.config.model import MergeAdapterConfig
from pipetrain.backend.errors import ModelError
from pipetrain.backend.models.registry import adapter_class
from pipetrain.backend.host.runtime import ensure_comfyui
from pipetrain.backend.parity.verify import comfy_lora_model

ensure_comfyui()


def _flux(files, merge=()):
    cfg = ModelConfig(type="flux", diffusion_model=str(files.diffusion_model), vae=str(files.vae),
                      text_encoders=[str(p) for p in files.text_encoders], dtype="float32",
                      merge_adapters=[str(p) for p in merge])
    adapter = adapter_class("flux")(cfg)
    adapter.load_diffusion_model()
    return adapter


def _random_lora(files, path, seed=1):
    """A LoRA in PipeTrain's (ComfyUI's) keys with non-zero B, so it changes the weights."""
    donor = _flux(files)
    injection.inject(donor.diffusion_model, injection.AdapterSpec(rank=4, alpha=8.0, seed=seed),
                     donor.lora_block_prefixes)
    g = torch.Generator().manual_seed(seed)
    for m in injection.adapted_modules(donor.diffusion_model):
        m.lora_B.weight.data.normal_(0, 0.05, generator=g)
    save_file(injection.state_dict(donor.diffusion_model), str(path))
    return path


def _flux_with_lora(files):
    a = _flux(files)
    injection.inject(a.diffusion_model, injection.AdapterSpec(rank=4, alpha=8.0), a.lora_block_prefixes)
    return a.diffusion_model


def test_merged_weights_equal_comfyuis_lora_patched_weights(micro_flux_files, tmp_path):
    first, second = _random_lora(micro_flux_files, tmp_path / "a.safetensors", 1), \
        _random_lora(micro_flux_files, tmp_path / "b.safetensors", 2)
    merged = _flux(micro_flux_files, [first, second]).diffusion_model.state_dict()

    base = _flux(micro_flux_files).patcher
    original = {k: v.clone() for k, v in base.model.diffusion_model.state_dict().items()}
    patched = comfy_lora_model(comfy_lora_model(base, first), second)
    patched.patch_model()   # bakes the patches into the (shared) model's weights, as ComfyUI does to sample
    expected = patched.model.diffusion_model.state_dict()
    changed = [k for k in expected if not torch.equal(expected[k], original[k])]
    # every adapted linear
    assert len(changed) == len(list(injection.adapted_modules(_flux_with_lora(micro_flux_files))))
    for k, v in expected.items():
        torch.testing.assert_close(merged[k], v, rtol=1e-6, atol=1e-7)
    patched.unpatch_model()


def test_a_lora_of_another_model_is_refused(micro_flux_files, tmp_path):
    other = tmp_path / "sdxl_lora.safetensors"
    save_file({"lora_unet_input_blocks_1_1_proj_in.lora_down.weight": torch.zeros(4, 8),
               "lora_unet_input_blocks_1_1_proj_in.lora_up.weight": torch.zeros(8, 4)}, str(other))
    with pytest.raises(ModelError, match="sdxl_lora.safetensors: none of its keys fits"):
        _flux(micro_flux_files, [other])


def test_a_weight_merges_the_lora_as_comfyui_applies_it_at_that_strength(micro_flux_files, tmp_path):
    """diffusion-pipe's fuse_adapters weight (read as a merge_adapters table): ComfyUI's strength."""
    lora = _random_lora(micro_flux_files, tmp_path / "a.safetensors", 3)
    cfg = ModelConfig(type="flux", diffusion_model=str(micro_flux_files.diffusion_model),
                      vae=str(micro_flux_files.vae), text_encoders=[str(p) for p in micro_flux_files.text_encoders],
                      dtype="float32", merge_adapters=[MergeAdapterConfig(str(lora), 0.5)])
    adapter = adapter_class("flux")(cfg)
    adapter.load_diffusion_model()
    merged = adapter.diffusion_model.state_dict()
    full = _flux(micro_flux_files, [lora]).diffusion_model.state_dict()

    base = _flux(micro_flux_files).patcher
    original = {k: v.clone() for k, v in base.model.diffusion_model.state_dict().items()}
    patched = comfy_lora_model(base, lora, 0.5)
    patched.patch_model()
    expected = patched.model.diffusion_model.state_dict()
    changed = [k for k in expected if not torch.equal(expected[k], original[k])]
    assert changed
    for k in changed:
        torch.testing.assert_close(merged[k], expected[k], rtol=1e-6, atol=1e-7)
        # half the strength: half the change of the LoRA merged as trained
        torch.testing.assert_close(merged[k] - original[k], (full[k] - original[k]) / 2, rtol=1e-3, atol=1e-6)
    patched.unpatch_model()
