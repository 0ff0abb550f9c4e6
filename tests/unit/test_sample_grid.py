# SPDX-License-Identifier: GPL-3.0-or-later
"""Sample names per strength, the strength read back, the epoch with the lowest held-out loss, and refusals."""
from pathlib import Path

import pytest

from pipetrain.backend.sampling.render import sample_paths, sample_strength
from pipetrain.launcher.summaries import _lora_of_sample, best_epoch


def test_names_keep_the_old_form_at_strength_one_and_carry_the_strength_otherwise():
    lora = Path("/runs/r/loras/r-epoch0002.safetensors")
    assert [p.name for p in sample_paths(lora, 2)] == ["r-epoch0002-sample00.png", "r-epoch0002-sample01.png"]
    names = [p.name for p in sample_paths(lora, 2, [0.6, 1.0])]
    assert names == ["r-epoch0002-sample00-x0.60.png", "r-epoch0002-sample01-x0.60.png",
                     "r-epoch0002-sample00-x1.00.png", "r-epoch0002-sample01-x1.00.png"]
    assert [sample_strength(n) for n in names] == [0.6, 0.6, 1.0, 1.0]
    assert sample_strength("r-epoch0002-sample00.png") == 1.0
    assert {_lora_of_sample(str(lora.parent / n)) for n in names} == {str(lora)}


def test_best_epoch_is_the_lowest_mean_held_out_loss_of_a_saved_epoch():
    events = [{"type": "lora_saved", "epoch": 1}, {"type": "eval", "epoch": 1, "name": "a", "loss": 0.30},
              {"type": "eval", "epoch": 1, "name": "b", "loss": 0.10},
              {"type": "lora_saved", "epoch": 2}, {"type": "eval", "epoch": 2, "name": "a", "loss": 0.25},
              {"type": "eval", "epoch": 2, "name": "b", "loss": 0.20},
              {"type": "eval", "epoch": 3, "name": "a", "loss": 0.01}]          # no LoRA of epoch 3
    assert best_epoch(events) == {"epoch": 1, "loss": pytest.approx(0.20)}
    assert best_epoch([{"type": "lora_saved", "epoch": 1}]) is None


@pytest.mark.parametrize("strengths,message", [([], "give 1 to 6"), ([-0.5, 1.0], "each from 0"),
                                               ([1.0, 1.0], "each strength once"), ([2.5], "to 2")])
def test_bad_strengths_are_refused_naming_the_key(strengths, message, micro_flux_files, make_run):
    from pipetrain.backend.config import load_run_config
    from pipetrain.backend.errors import ConfigError

    config = make_run(micro_flux_files, images=1, samples={"prompts": ["x"], "strengths": strengths})
    with pytest.raises(ConfigError, match=f"samples.strengths.*{message}"):
        load_run_config(config)


def test_strength_0_is_the_base_model_row(micro_flux_files, make_run):
    from pipetrain.backend.config import load_run_config

    cfg = load_run_config(make_run(micro_flux_files, images=1, samples={"prompts": ["x"], "strengths": [0, 1.0]}))
    assert cfg.samples.strengths == [0.0, 1.0]
    paths = sample_paths(Path("/r/l-epoch0001.safetensors"), 1, cfg.samples.strengths)
    assert [p.name for p in paths] == ["l-epoch0001-sample00-x0.00.png", "l-epoch0001-sample00-x1.00.png"]
    assert [sample_strength(str(p)) for p in paths] == [0.0, 1.0]


def test_a_full_fine_tune_has_no_strengths(micro_flux_files, make_run):
    from pipetrain.backend.config import load_run_config
    from pipetrain.backend.errors import ConfigError

    config = make_run(micro_flux_files, images=1, adapter=None, samples={"prompts": ["x"], "strengths": [0.5, 1.0]})
    with pytest.raises(ConfigError, match="samples.strengths"):
        load_run_config(config)


def test_strength_0_samples_the_base_model_itself_as_comfyuis_lora_loader_does(micro_flux_files, tmp_path):
    """ComfyUI's LoraLoaderModelOnly returns the model it was given at strength 0; the samples' strength-0 row takes
    that model too (no LoRA patches to compute into its weights), and a non-zero strength patches a copy."""
    import torch
    from safetensors.torch import save_file

    from pipetrain.backend.config import ModelConfig
    from pipetrain.backend.host.runtime import ensure_comfyui
    from pipetrain.backend.models.registry import adapter_class
    from pipetrain.backend.sampling.render import _with_lora

    ensure_comfyui()
    files = micro_flux_files
    cfg = ModelConfig(type="flux", diffusion_model=str(files.diffusion_model), vae=str(files.vae),
                      text_encoders=[str(p) for p in files.text_encoders], dtype="float32")
    base = adapter_class("flux")(cfg).load_diffusion_model()
    width, channels = base.model.diffusion_model.img_in.weight.shape
    lora = tmp_path / "epoch0001.safetensors"
    save_file({"diffusion_model.img_in.lora_up.weight": torch.ones(width, 1),
               "diffusion_model.img_in.lora_down.weight": torch.ones(1, channels)}, str(lora))
    assert _with_lora(base, lora, 0.0) is base and not base.patches
    patched = _with_lora(base, lora, 1.0)
    assert patched is not base and list(patched.patches) == ["diffusion_model.img_in.weight"] and not base.patches
