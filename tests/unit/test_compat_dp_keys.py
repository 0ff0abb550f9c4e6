"""Same keys, same training: each key diffusion-pipe (8f83dbf) reads, at its value or its default there, gives the
training value diffusion-pipe's code gives, or check-config names the difference on its own line.

diffusion-pipe's facts used below (its train.py, utils/saver.py and models/*.py): ``shift`` wins over ``flux_shift``
and neither means unshifted timesteps; ``partition_method = 'parameters'`` (its default) balances the count of *all*
of a layer's parameters (it replaces DeepSpeed's count of trainable ones); one-dimensional parameters train without
weight decay; a relative path is read from the working directory; the rest of its defaults are in ``DP_DEFAULTS``.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_compat_dp_examples import ADAPTER, DATASETS, LOADS, MAIN, OPTIMIZER, _model, _write

from pipetrain.backend.config import compat
from pipetrain.backend.commands.check_config import report
from pipetrain.backend.config import load_run_config
from pipetrain.backend.preflight import load_run

# diffusion-pipe's defaults for the keys its main_example leaves out (set_config_defaults, config.get(key, default)):
# dotted key -> its value there, as our config holds it
DP_DEFAULTS = {
    "pipeline_stages": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "micro_batch_size_per_gpu": 1,
    "warmup_steps": 0, "lr_scheduler": "constant", "activation_checkpointing": False, "blocks_to_swap": 0,
    "caching_batch_size": 1, "steps_per_print": 1, "uncond_fraction": 0.0, "eval_before_first_step": True,
    "eval_gradient_accumulation_steps": 1, "compile": False, "eval_every_n_epochs": None,
    "eval_every_n_steps": None, "max_steps": None, "checkpoint_every_n_epochs": None,
    "model.guidance": 1.0, "model.timestep_sample_method": "logit_normal", "model.sigmoid_scale": 1.0,
    "model.shift": None, "model.flux_shift": False,
    "adapter.type": "lora", "adapter.dropout": 0.0, "adapter.decompose_factor": -1,
    "adapter.init_from_existing": None,
}
BARE_MAIN = "output_dir = 'out'\ndataset = 'dataset.toml'\nepochs = 3\nsave_every_n_epochs = 1\n"
FLOW_TABLES = [case for case in LOADS if case[2] != "cosmos"]   # Cosmos 1.0 trains EDM, not rectified flow


def _value(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def test_every_default_left_out_is_diffusion_pipes_or_check_config_names_it(tmp_path):
    path = _write(tmp_path, BARE_MAIN + _model("hunyuan_video", LOADS[0][3]) + "[adapter]\nrank = 4\n" + OPTIMIZER)
    cfg = load_run(path)
    text, ok = report(path)
    assert ok, text
    listed = {key for _, key, _, _ in compat.DEFAULT_DIFFERENCES}
    for key, dp in DP_DEFAULTS.items():
        assert _value(cfg, key) == dp or key in listed, key
    for _, key, dp, ours in compat.DEFAULT_DIFFERENCES:
        if key in ("partition_method", "adapter.dtype", "adapter.alpha", "save_dtype", "skip_empty_caption"):
            assert f"  {key} (" in text and f"diffusion-pipe {dp}; here {ours}" in text, (key, text)


@pytest.mark.parametrize("case, arch, ours, model", FLOW_TABLES, ids=[c[0] for c in FLOW_TABLES])
def test_shift_left_out_trains_unshifted_or_check_config_names_the_models_shift(tmp_path, case, arch, ours, model):
    """dp's prepare_inputs shifts only when ``shift`` or ``flux_shift`` is set; a model here that trains at ComfyUI's
    sampling shift instead says so, with the value, on its own line (HunyuanVideo: 7, as the issue found)."""
    from pipetrain.backend.models.registry import adapter_class

    model = "\n".join(line for line in model.splitlines() if not line.startswith("shift"))
    path = _write(tmp_path, MAIN + _model(arch, model) + ADAPTER + OPTIMIZER)
    cfg = load_run(path)
    objective = adapter_class(cfg.model.type)(cfg.model, cfg.resolve).objective()
    text, ok = report(path)
    assert ok, text
    lines = [line for line in text.splitlines() if line.startswith("  model.shift (main file): diffusion-pipe none")]
    t = torch.tensor([0.2, 0.5, 0.8])
    if torch.allclose(objective._shift(t, 4096), t):   # unshifted at this size: as diffusion-pipe
        assert lines == [], text
    else:
        assert len(lines) == 1 and objective.shift_text() in lines[0], text
        if arch == "hunyuan_video":
            assert "a constant shift of 7 " in lines[0]


def test_shift_wins_over_flux_shift(tmp_path):
    from pipetrain.backend.models.registry import adapter_class
    from comfy.model_sampling import time_snr_shift

    flux = "type = 'flux'\ntransformer_path = '{dm}'\nvae_path = '{vae}'\ntext_encoders = ['{te0}', '{te1}']\n" \
           "dtype = 'bfloat16'\nflux_shift = true\nshift = 3.0\n"
    path = _write(tmp_path, MAIN + _model("flux", flux) + ADAPTER + OPTIMIZER)
    cfg = load_run(path)
    objective = adapter_class("flux")(cfg.model, cfg.resolve).objective()
    t = torch.tensor([0.1, 0.5, 0.9])
    assert torch.allclose(objective._shift(t, 4096), time_snr_shift(3.0, t).float())
    assert "  model.flux_shift: not applied: shift is set" in report(path)[0]
    # flux_shift alone: Flux's resolution-dependent shift, not a model's default constant
    sd3 = _model("sd3", "type = 'sd3'\ndiffusion_model = '{dm}'\nvae = '{vae}'\ntext_encoders = ['{te0}', '{te1}']\n"
                 "flux_shift = true\n")
    cfg = load_run(_write(tmp_path, MAIN + sd3 + ADAPTER + OPTIMIZER))
    objective = adapter_class("sd3")(cfg.model, cfg.resolve).objective()
    assert objective.shift is None and objective.flux_shift


def test_partition_by_parameters_counts_every_parameter(micro_flux_files):
    """With a LoRA the frozen weights are most of each layer: dp balances the stages on them, not on the LoRA's."""
    from deepspeed.runtime import utils as ds_utils

    from pipetrain.backend.adapters import injection
    from pipetrain.backend.config import ModelConfig
    from pipetrain.backend.models.registry import adapter_class
    from pipetrain.backend.train.pipeline import partition_bounds

    cfg = ModelConfig(type="flux", diffusion_model=str(micro_flux_files.diffusion_model), vae=str(micro_flux_files.vae),
                      text_encoders=[str(p) for p in micro_flux_files.text_encoders], dtype="float32")
    adapter = adapter_class("flux")(cfg)
    adapter.load_diffusion_model()
    adapter.diffusion_model.requires_grad_(False)
    injection.inject(adapter.diffusion_model, injection.AdapterSpec(rank=4, alpha=4.0), adapter.lora_block_prefixes)
    layers = adapter.to_layers()
    every = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    trainable = [sum(p.numel() for p in layer.parameters() if p.requires_grad) for layer in layers]
    for stages in (2, 3):
        bounds = partition_bounds("parameters", layers, [1.0] * len(layers), stages, None)
        assert bounds == ds_utils.partition_balanced(weights=every, num_parts=stages)
    # DeepSpeed's own count (trainable only) cuts elsewhere: the input and output layers hold no LoRA
    assert any(ds_utils.partition_balanced(weights=trainable, num_parts=stages) != partition_bounds(
        "parameters", layers, [1.0] * len(layers), stages, None) for stages in (2, 3, 4))


def test_one_dimensional_parameters_train_without_weight_decay(micro_flux_files, tmp_path):
    """A full fine-tune: biases and norm scales in a group with weight_decay 0, matrices with the config's."""
    from pipetrain.backend.config import ModelConfig
    from pipetrain.backend.models.registry import adapter_class
    from pipetrain.backend.optim.registry import make_optimizer

    cfg = ModelConfig(type="flux", diffusion_model=str(micro_flux_files.diffusion_model), vae=str(micro_flux_files.vae),
                      text_encoders=[str(p) for p in micro_flux_files.text_encoders], dtype="float32")
    adapter = adapter_class("flux")(cfg)
    adapter.load_diffusion_model()
    params = list(adapter.diffusion_model.parameters())
    (tmp_path / "images").mkdir()
    run = _write(tmp_path, BARE_MAIN + _model("flux", "type = 'flux'\ndiffusion_model = '{dm}'\nvae = '{vae}'\n"
                                                      "text_encoders = ['{te0}', '{te1}']\n") + OPTIMIZER,
                 "[[directory]]\npath = 'images'\n")
    optimizer = make_optimizer(load_run_config(run), 1)(params)
    decay = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    assert {decay[id(p)] for p in params if p.ndim == 1} == {0.0}
    assert {decay[id(p)] for p in params if p.ndim > 1} == {0.01}
    assert sum(p.ndim == 1 for p in params) > 0 and len(decay) == len(params)


def test_relative_paths_read_from_the_working_directory_where_only_it_has_them(tmp_path, monkeypatch):
    """dp's main_example names ``examples/dataset.toml`` from its repository's root: that works run from there;
    a path beside the config still wins (our own configs), and check-config says which applies."""
    examples = tmp_path / "examples"
    examples.mkdir()
    (tmp_path / "images").mkdir()
    run = _write(examples, MAIN.replace("dataset = 'dataset.toml'", "dataset = 'examples/dataset.toml'") +
                 _model("hunyuan_video", LOADS[0][3]) + ADAPTER + OPTIMIZER, DATASETS["dataset"])
    monkeypatch.chdir(tmp_path)
    cfg = load_run(run)
    assert cfg.resolve(cfg.dataset) == (examples / "dataset.toml").resolve()
    assert cfg.dataset_config.directory_path(cfg.dataset_config.directory[0]) == tmp_path / "images"
    text, ok = report(run)
    assert ok, text
    assert "  dataset: DIFFERENT: a relative path, read from the working directory" in text
    assert "  directory[0].path: DIFFERENT: a relative path, read from the working directory" in text
    assert "  output_dir: DIFFERENT: a relative path, read from this file's folder" in text
    (examples / "images").mkdir()   # a folder beside the dataset file wins
    cfg = load_run(run)
    assert cfg.dataset_config.directory_path(cfg.dataset_config.directory[0]) == examples / "images"
    monkeypatch.chdir(examples)   # the config's own folder: both rules read the same files, nothing to say
    assert "DIFFERENT: a relative path" not in report(Path("run.toml").resolve())[0]
