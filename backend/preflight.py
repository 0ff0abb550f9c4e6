"""The checks a run passes before anything starts, in one place for the nodes, the launcher and the CLI.

Loading a config checks what holds for every model (``backend/config``); the model type's own rules (is it
available on this ComfyUI, its timestep range, a CLIP-vision file, its text encoders' types) belong to its
architecture class (``ModelAdapter.check_config``) and run here.
"""
from __future__ import annotations

from pathlib import Path

from .config import ModelConfig, RunConfig, load_run_config
from .errors import ConfigError


def check_model(model: ModelConfig, file) -> None:
    """``[model]`` against its architecture; raises ``ConfigError`` naming ``file`` and the key."""
    from .models.registry import adapter_class, unavailable_reason

    reason = unavailable_reason(model.type)   # unknown, or needs a newer ComfyUI (named in the message)
    if reason:
        raise ConfigError(reason, file=file, key="model.type")
    adapter_class(model.type).check_config(model, file)


def check_checkpoint_parts(model: ModelConfig) -> None:
    """The parts ``[model]`` leaves to its all-in-one checkpoint (no vae, no text encoders) are in the file; a
    header read (``ModelError`` naming the key to set)."""
    if model.from_checkpoint():
        from .models.checkpoint_file import check_parts
        from .host.runtime import ensure_comfyui

        ensure_comfyui()   # ComfyUI's model config tells the parts apart (after the CLI chose which ComfyUI)
        check_parts(model.diffusion_model, model.type, model.from_checkpoint())


def check_run(cfg: RunConfig) -> RunConfig:
    from .sampling import audio as sample_audio
    from .sampling.clips import check_samples

    check_model(cfg.model, cfg.file)
    check_samples(cfg)   # clip length and start image against the model type
    sample_audio.check_samples(cfg)   # lyrics only for audio models
    check_preservation(cfg)
    if cfg.monitoring is not None and cfg.monitoring.enable_wandb:
        import importlib.util
        if importlib.util.find_spec("wandb") is None:
            raise ConfigError("Weights & Biases is not installed in this Python: pip install wandb, or set "
                              "enable_wandb = false (the run logs to TensorBoard either way)", file=cfg.file,
                              key="monitoring.enable_wandb")
    if cfg._dataset is not None:   # edit models need control images, other models take none: said before caching
        from .data import check_control_paths
        from .models.registry import adapter_class

        adapter = adapter_class(cfg.model.type)
        check_control_paths(cfg.dataset_config, adapter, str(cfg.resolve(cfg.dataset)))
        for name, ds in cfg.eval_dataset_configs().items():
            check_control_paths(ds, adapter, f"eval dataset {name!r}")
    check_checkpoint_parts(cfg.model)   # last (it reads a file): a header read where [model] leaves parts to the file
    return cfg


def check_preservation(cfg: RunConfig) -> None:
    """diff_output_preservation tells the target rows apart by their place on the first dimension of each adapted
    layer's input (``lora.base_rows``): a model whose layers see tokens in another order cannot use it."""
    from .models.registry import adapter_class

    if cfg.diff_output_preservation and not adapter_class(cfg.model.type).samples_first:
        raise ConfigError(f"a {cfg.model.type} model's adapted layers do not see the samples on their first "
                          "dimension (routed experts, or tokens before the batch), where differential output "
                          "preservation tells its target rows apart: set diff_output_preservation = false",
                          file=cfg.file, key="diff_output_preservation")


def load_run(path: str | Path) -> RunConfig:
    """A run file loaded, its dataset files read, and checked against its architecture: what a run trains on."""
    return check_run(load_run_config(path))
