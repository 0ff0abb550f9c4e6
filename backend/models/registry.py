"""Model type string -> adapter class. Adding a model is one line here plus its module."""
from __future__ import annotations

import importlib

# type string -> "module:Class" (imported lazily so only the chosen model's code loads)
ADAPTERS: dict[str, str] = {
    "flux": "pipetrain.backend.models.flux:FluxAdapter",
    "sdxl": "pipetrain.backend.models.sdxl:SDXLAdapter",
}


def adapter_class(model_type: str):
    try:
        target = ADAPTERS[model_type]
    except KeyError:
        raise KeyError(f"unknown model type {model_type!r}; supported: {', '.join(sorted(ADAPTERS))}") from None
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)
