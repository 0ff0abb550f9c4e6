# SPDX-License-Identifier: GPL-3.0-or-later
"""The ComfyUI versions PipeTrain is tested with: the one place that names them.

A ComfyUI outside the range still runs: the run warns and relies on the parity check (``parity/check.py``), which
compares our layers with that ComfyUI's own forward before anything is cached.
"""
from __future__ import annotations

import re

# every version here ran the parity and end-to-end tests (tests/ranks/test_parity_versions.py); the
# compatibility table in docs/models.md shows the verdict per model type
TESTED_VERSIONS = ("0.3.52", "0.3.64", "0.3.75", "0.8.0", "0.33.0")
TESTED_RANGE = f"{TESTED_VERSIONS[0]} to {TESTED_VERSIONS[-1]}"
# the versions every model type passes on (older tested versions pass for some: docs/models.md's table), but the
# types whose code a later ComfyUI brought (``ArchSpec.min_comfyui``: Flux 2 Klein), which pass from that one on
EVERY_TYPE_PASSES_ON = "0.3.75, 0.8.0 and 0.33.0"


def parse(version: str) -> tuple[int, ...] | None:
    """``"0.3.75"`` -> (0, 3, 75); None for what is not a dotted version."""
    m = re.match(r"^v?(\d+(?:\.\d+)*)", version.strip())
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


def in_tested_range(version: str) -> bool:
    v = parse(version)
    return v is not None and parse(TESTED_VERSIONS[0]) <= v <= parse(TESTED_VERSIONS[-1])


def read_version(root) -> str:
    """The version a ComfyUI folder declares (``comfyui_version.py``, else ``pyproject.toml``), without importing
    it; "unknown" when neither says."""
    from pathlib import Path

    root = Path(root)
    for name, pattern in (("comfyui_version.py", r'__version__\s*=\s*["\']([^"\']+)'),
                          ("pyproject.toml", r'(?m)^version\s*=\s*["\']([^"\']+)')):
        try:
            m = re.search(pattern, (root / name).read_text(errors="replace"))
        except OSError:
            continue
        if m and parse(m.group(1)):
            return m.group(1)
    return "unknown"


def range_warning(version: str) -> str:
    """A warning for a ComfyUI outside the tested range, "" inside it."""
    if in_tested_range(version):
        return ""
    return (f"ComfyUI {version} is outside the versions PipeTrain is tested with ({TESTED_RANGE}): the run relies "
            f"on the parity check of this model type against its model code")


def pinned_hint() -> str:
    from .runtime import PINNED_COMFYUI, PINNED_VERSION

    if (PINNED_COMFYUI / "comfy").is_dir():
        return f"train with PipeTrain's pinned ComfyUI {PINNED_VERSION} (COMFYUI_PATH={PINNED_COMFYUI})"
    return f"install PipeTrain's pinned ComfyUI {PINNED_VERSION} with scripts/setup.sh and train with it"


def comfyui_info() -> dict:
    """The ComfyUI this process runs: version, folder and whether it is in the tested range (for events/status)."""
    from .runtime import ensure_comfyui

    from .patches_comfyui import kitchen_in_training

    root = ensure_comfyui()
    version = read_version(root)
    # the comfy-kitchen fused kernels that training runs through comfy-kitchen's eager backend (none fused: they
    # register no backward); [] where this ComfyUI does not use comfy-kitchen
    return {"version": version, "path": str(root), "tested": in_tested_range(version), "tested_range": TESTED_RANGE,
            "kitchen_eager_in_training": kitchen_in_training()}
