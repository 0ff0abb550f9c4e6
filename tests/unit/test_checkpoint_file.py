# SPDX-License-Identifier: GPL-3.0-or-later
"""All-in-one checkpoints are read the same way for every type that has them: an SDXL checkpoint (ComfyUI's
``first_stage_model.`` VAE and ``conditioner.embedders.`` CLIP-L + CLIP-G, which SDXL's process_clip_state_dict
renames) gives the VAE latents, text embeddings and diffusion weights of the separate files, exactly."""
import pytest
import torch

pytestmark = pytest.mark.slow   # a real-size SDXL VAE is written twice (about 15 s)


def test_sdxl_checkpoint_equals_its_separate_files(tmp_path):
    from safetensors import safe_open

    from pipetrain.backend.config import ModelConfig
    from pipetrain.backend.errors import ModelError
    from pipetrain.backend.models import tiny
    from pipetrain.backend.models.checkpoint_file import check_parts
    from pipetrain.backend.models.registry import adapter_class

    checkpoint = tiny.write_checkpoint("sdxl", tmp_path / "ckpt" / "sdxl_tiny.safetensors")
    split = tiny.write_model_files("sdxl", tmp_path / "split", "tiny")
    with safe_open(str(checkpoint), framework="pt") as f:
        assert {k.split(".")[0] for k in f.keys()} == {"model", "first_stage_model", "conditioner"}
    check_parts(checkpoint, "sdxl", {"vae", "text_encoders"})   # told from the header alone
    with pytest.raises(ModelError, match="holds no text encoders"):
        check_parts(split.diffusion_model, "sdxl", {"text_encoders"})
    sdxl = adapter_class("sdxl")
    whole = sdxl(ModelConfig(type="sdxl", diffusion_model=str(checkpoint), dtype="float32"))
    separate = sdxl(ModelConfig(type="sdxl", diffusion_model=str(split.diffusion_model), vae=str(split.vae),
                                text_encoders=[str(p) for p in split.text_encoders], dtype="float32"))
    pixels = torch.rand(1, 64, 64, 3, generator=torch.Generator().manual_seed(0))
    latent = whole.encode_images(whole.load_vae(), pixels)
    assert latent.shape == (1, 4, 8, 8) and latent.abs().max() > 0
    torch.testing.assert_close(latent, separate.encode_images(separate.load_vae(), pixels), rtol=0, atol=0)
    text = whole.encode_caption(whole.load_text_encoders(), "a red fox in the snow")
    split_text = separate.encode_caption(separate.load_text_encoders(), "a red fox in the snow")
    assert set(text) == set(split_text) == {"cond", "pooled"}
    for key in text:
        torch.testing.assert_close(text[key], split_text[key], rtol=0, atol=0)
    whole.load_diffusion_model()
    separate.load_diffusion_model()
    a, b = whole.diffusion_model.state_dict(), separate.diffusion_model.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in b)
