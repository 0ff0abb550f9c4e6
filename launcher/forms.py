# SPDX-License-Identifier: GPL-3.0-or-later
"""The setting nodes' widgets as run keys: what each form means where a widget is not simply its key.

A widget showing 0 for a key whose default is "unset" leaves the key out; the Memory node's three checkpointing
switches are one key; the Adapter node's ``full`` is no ``[adapter]`` table. Everything else is the key itself,
under its section's prefix. Free of ComfyUI imports, so tests build exactly what the nodes build.
"""
from __future__ import annotations

from pathlib import Path

from ..backend.config.patch import RunPatch
from ..backend.errors import ConfigError
from ..backend.sampling.clips import image_problem, media_problem

FULL_FINETUNE = "full"   # the Adapter node's type without an [adapter] table: every weight trains


def unset_if_zero(value):
    """A 0 widget on a key whose default is unset (an optional count, a duration): the key is left out."""
    return value or None


def checkpointing_mode(enabled: bool, offload_activations: bool = False, selective: bool = False):
    """The Memory node's switches as ``activation_checkpointing``'s value."""
    if not enabled:
        return False
    if offload_activations and selective:
        raise ConfigError("offload_activations and selective are two ways of checkpointing; turn one of them off",
                          file="Memory node", key="selective")
    return "unsloth" if offload_activations else "selective" if selective else True


def adapter_patch(keys: dict) -> RunPatch:
    """``keys``: the Adapter node's [adapter] keys (alpha 0: alpha = rank)."""
    if keys.get("type") == FULL_FINETUNE:
        return RunPatch()   # diffusion-pipe: no [adapter] table means a full fine-tune
    keys = {**keys, "alpha": unset_if_zero(keys.get("alpha")), "target_modules": keys.get("target_modules") or None}
    return RunPatch.of(keys, "adapter")


def memory_patch(activation_checkpointing: bool, offload_activations: bool = False, selective: bool = False,
                 checkpoint_fraction: float = 1.0, compile: bool = False,  # noqa: A002
                 memory_budget: float = 1.0, **keys) -> RunPatch:
    """The Memory node: the checkpointing switches as one key; the fraction only with checkpointing, the memory
    budget only with compile (1 means off); ``keys``: the other run keys as they are."""
    mode = checkpointing_mode(activation_checkpointing, offload_activations, selective)
    return RunPatch.of({**keys, "activation_checkpointing": mode, "compile": compile,
                        "activation_checkpointing_fraction": checkpoint_fraction if mode and checkpoint_fraction < 1
                        else None,
                        "activation_memory_budget": memory_budget if compile and memory_budget < 1 else None})


def loss_patch(loss_type: str = "mse", huber_delta: float = 1.0, smooth_l1_beta: float = 1.0,
               noise_offset: float = 0.0) -> RunPatch:
    """The Optimizer node's loss widgets: each loss parameter only with its loss (the other's widget shows a
    value nobody asked for), noise_offset 0 left out (off)."""
    return RunPatch.of({"loss_type": loss_type, "huber_delta": huber_delta if loss_type == "huber" else None,
                        "smooth_l1_beta": smooth_l1_beta if loss_type == "smooth_l1" else None,
                        "noise_offset": unset_if_zero(noise_offset)})


def preservation_patch(diff_output_preservation: bool = False, trigger_word: str = "",
                       diff_output_preservation_class: str = "person",
                       diff_output_preservation_multiplier: float = 1.0) -> RunPatch:
    """The LoRA Adapter node's differential output preservation widgets: off leaves every key out (the config
    refuses its keys without it)."""
    if not diff_output_preservation:
        return RunPatch.of({})
    return RunPatch.of({"diff_output_preservation": True, "trigger_word": trigger_word.strip() or None,
                        "diff_output_preservation_class": diff_output_preservation_class.strip() or None,
                        "diff_output_preservation_multiplier": diff_output_preservation_multiplier})


def model_patch(type: str, diffusion_model: str, vae: str, text_encoders=(), **keys) -> RunPatch:  # noqa: A002
    """``[model]`` as run keys (the Model node's, or a test's)."""
    return RunPatch.of({**keys, "type": type, "diffusion_model": diffusion_model, "vae": vae,
                        "text_encoders": tuple(text_encoders)}, "model")


def folder_patch(path: str, **keys) -> RunPatch:
    """One ``[[directory]]`` as keys (a Dataset node's folder)."""
    return RunPatch.of({**keys, "path": path})


def input_image(root: str | Path, name: str, widget: str, video: bool = False, whole: bool = True) -> Path:
    """An image a widget names by its path under ComfyUI's input directory ``root`` (what LoadImage lists), as an
    absolute path: no absolute path, no ``..``, no link leading out of the folder, and a readable image
    (ValueError naming ``widget`` otherwise); ``video``: a readable video or image (a control video).

    ``whole=False``: the queue-time check, on ComfyUI's event loop: a regular file whose header says it is an image
    (or a video container with a video stream), whatever its size. Reading it whole (an image's every chunk, a
    video's every frame) is for when the node runs, on ComfyUI's worker thread: a many-frame clip or a 100 MB
    upload, named by many nodes of one prompt, would hold every request up meanwhile."""
    root = Path(root).resolve()
    relative = Path(name.strip())
    if relative.is_absolute() or ".." in relative.parts:
        raise ValueError(f"{widget} {name!r}: name a file under ComfyUI's input directory (e.g. start.png), "
                         "without .. or an absolute path")
    path = (root / relative).resolve()
    if not path.is_relative_to(root):
        raise ValueError(f"{widget} {name!r}: leads out of ComfyUI's input directory")
    problem = media_problem(path, whole) if video else image_problem(path, whole)
    if problem:
        what = "video or image" if video else "image"
        raise ValueError(f"{widget} {name!r}: {problem}; upload the {what} to ComfyUI's input directory")
    return path
