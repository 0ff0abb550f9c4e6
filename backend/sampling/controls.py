# SPDX-License-Identifier: GPL-3.0-or-later
"""Epoch samples of control-video models (wan_vace, wan_fun_control): a LoRA trained on (control, clip) pairs is
only judged by clips rendered with a control, so each sample renders with the control of the dataset's first
controlled clip (by control file name, as edit models' ``sampling.sample_control`` picks theirs; a still's only
where the dataset has no clip: its control is one frame, which the node would pad to the clip). Its files are
read as training reads them (``cache.builder.control_inputs``) at the sample's size and frame count: the control
video cropped to the size and cut to ``[samples] frames`` (a shorter one, or an image, is filled by the node as in
training); wan_vace adds the item's control mask and reference image where the dataset has them; wan_fun_control
(``[model] control_start_image``, the default) its start image: ``[samples] start_image``, else the item's first
frame. ``[samples] control_video`` replaces the control alone: the item's mask, drawn for its own control, is
left out (generate everywhere); its reference image and first frame stay. ComfyUI's WanVaceToVideo /
WanFunControlToVideo build the conditioning (the adapter's ``control_conditioning``, which training's
``encode_conditioning`` goes through too).
"""
from __future__ import annotations

import torch

from ..config import RunConfig
from ..data.items import MediaItem
from ..errors import ConfigError


def control_item(cfg: RunConfig) -> MediaItem:
    """The dataset's controlled clip whose control file name sorts first (then its own name); a still only where
    the dataset has no clip."""
    from ..data import scan_dataset

    items = [item for item in scan_dataset(cfg.dataset_config, videos=True).items if item.control is not None]
    if not items:
        raise ConfigError(f"{cfg.model.type} samples render with a control video, and the dataset pairs none with "
                          "its clips: set control_path on its [[directory]] tables", file=cfg.file, key="samples")
    return min(items, key=lambda item: (item.frames == 1, item.control, item.path))


def control_inputs(cfg: RunConfig, adapter) -> dict[str, torch.Tensor]:
    """The keyword inputs of ``adapter.control_conditioning`` for the samples: ``control`` [F, H, W, 3] and, as the
    model takes them, ``control_mask``, ``reference`` [1, H, W, 3] and ``start_image`` [1, H, W, 3]."""
    from ..cache.builder import control_inputs as read_controls
    from .clips import check_samples

    s, item = cfg.samples, control_item(cfg)
    if s.control_video is not None:
        check_samples(cfg)   # the file may have changed since the run was queued
    control = cfg.resolve(s.control_video) if s.control_video is not None else item.control
    mask = item.control_mask if s.control_video is None else None
    vace = (mask, item.reference) if adapter.vace_inputs else (None, None)
    control, more = read_controls(adapter, (s.width, s.height, s.frames), str(control), (),
                                  *(str(p) if p else None for p in vace))
    inputs = {"control": control, **more}
    if adapter.takes_control_start_image and adapter.start_image:
        inputs["start_image"] = start_image(cfg, adapter, item)
    return inputs


def start_image(cfg: RunConfig, adapter, item: MediaItem) -> torch.Tensor:
    """``[samples] start_image``, else the first frame of the item the control belongs to (a still: itself)."""
    from ..data import load_pixels
    from .clips import start_images

    s = cfg.samples
    if s.start_image is None and item.frames == 1:
        return load_pixels(item.path, (s.width, s.height))[None]
    return start_images(cfg, adapter, clip=item.path)[0]
