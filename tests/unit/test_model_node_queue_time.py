"""The Model node's queue-time check runs on ComfyUI's event loop: it tells a file's architecture only where the
header tells it at once (a safetensors header of at most ``QUEUE_TIME_HEADER`` bytes), once per version of the file;
anything else is told when the node runs, on ComfyUI's worker thread, and refused there just the same."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

from pipetrain.backend.host.runtime import ensure_comfyui

ensure_comfyui()
import folder_paths  # noqa: E402

from pipetrain.nodes import data  # noqa: E402


@pytest.fixture
def models(tmp_path, monkeypatch):
    monkeypatch.setattr(folder_paths, "folder_names_and_paths", dict(folder_paths.folder_names_and_paths))
    folder_paths.folder_names_and_paths["diffusion_models"] = ([str(tmp_path)], {".safetensors", ".ckpt"})
    folder_paths.folder_names_and_paths["checkpoints"] = ([str(tmp_path / "none")], {".safetensors"})
    return tmp_path


def test_a_header_too_large_or_a_pickle_is_told_when_the_node_runs(models):
    save_file({"w": torch.zeros(1)}, str(models / "junk.safetensors"))
    save_file({"w": torch.zeros(1)}, str(models / "padded.safetensors"), metadata={"pad": "x" * (3 << 20)})
    torch.save({"w": torch.zeros(1)}, models / "junk.ckpt")
    assert "not a diffusion model" in data.model_input_error("junk.safetensors", queue_time=True)
    for name in ("padded.safetensors", "junk.ckpt"):
        assert data.model_input_error(name, queue_time=True) is None, name       # not read on the event loop
        assert "not a diffusion model" in data.model_input_error(name), name     # when the node runs


def test_the_verdict_is_kept_per_version_of_the_file(models):
    from pipetrain.backend.models.loading import META_ARCH, META_UNET

    path = models / "model.safetensors"
    save_file({"w": torch.zeros(1)}, str(path))
    assert "not a diffusion model" in data.model_input_error("model.safetensors", queue_time=True)
    save_file({"w": torch.zeros(2)}, str(path), metadata={META_ARCH: "sdxl", META_UNET: "{}"})
    os.utime(path, ns=(1, 1))                   # another version of the file: its size and time differ
    assert data.model_input_error("model.safetensors", queue_time=True) is None
