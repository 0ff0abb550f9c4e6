# SPDX-License-Identifier: GPL-3.0-or-later
"""One ComfyUI's side of the pinned-fallback decision (``parity/fallback.py``), run in a child process per ComfyUI
(two ComfyUIs cannot share one process): ``python -m pipetrain comfyui-probe ...`` with ``COMFYUI_PATH`` naming it.

- ``forward``: its parity verdict and, unless that passes, its own model's forward (ComfyUI's model class and
  forward, none of PipeTrain's layers) at the probe, on weights seeded by parameter name so that two ComfyUIs hold
  the same ones; the parent compares the two forwards it saved.
- ``lora``: a saved LoRA loaded by its own ``LoraLoaderModelOnly``, counting what the loader applied.

The result goes to the parent as JSON on stdout's last line.
"""
from __future__ import annotations

import json
import logging
import zlib
from pathlib import Path

from ..errors import RuntimeSetupError


def _fill_by_name(module) -> None:
    """Random weights that depend only on each tensor's name and shape, so two ComfyUIs that build the same model
    (in whatever order) hold the same weights."""
    import torch

    with torch.no_grad():
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if t.is_floating_point():
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                t.copy_(torch.randn(t.shape, generator=g, dtype=t.dtype) * 0.05)


def _lacks(e: BaseException, root: Path) -> bool:
    """Whether building the model failed because this ComfyUI lacks (part of) the model's code: a comfy module
    that is not there, or a name ComfyUI's own code looks up in vain."""
    from .check import _origin

    if isinstance(e, ImportError):
        return (getattr(e, "name", None) or "").startswith("comfy")
    return isinstance(e, AttributeError) and _origin(e, root).startswith("comfy/")


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def probe_forward(model_type: str, out: Path, *, parity_first: bool) -> dict:
    """In a child process: this ComfyUI's parity verdict (``parity_first``) and, unless it passes, its own forward
    at the probe (ComfyUI's model class and forward, none of PipeTrain's layers) saved to ``out``."""
    import torch

    from . import check as parity
    from ..host.runtime import comfy_training_paths, ensure_comfyui
    from ..host.versions import read_version

    root = ensure_comfyui()
    info: dict = {"path": str(root), "version": read_version(root)}
    if parity_first:
        verdict = parity.check_model_type(model_type)
        info["parity"] = verdict.to_json()
        if verdict.ok:
            return info
        if verdict.verdict == "lacks":
            info["lacks"] = verdict.detail
            return info
    with torch.inference_mode(False):
        try:
            adapter = parity._small_adapter(model_type)
        except Exception as e:  # noqa: BLE001  (the host's own model cannot be built: the verdict says why)
            info["lacks" if _lacks(e, root.resolve()) else "error"] = (
                f"its own {model_type} model cannot be built ({_one_line(e)} at {parity._origin(e, root.resolve())})")
            return info
        dm = adapter.diffusion_model
        _fill_by_name(dm)
        x0, noise, t, text = parity._probe(adapter)
        try:
            with torch.no_grad(), comfy_training_paths(parity.reference_on_training_paths(adapter)):
                output = adapter.reference_forward(adapter.objective().noisy(x0, noise, t), t, text)
        except Exception as e:  # noqa: BLE001
            info["error"] = f"its own forward raised {_one_line(e)} at {parity._origin(e, root.resolve())}"
            return info
    torch.save({"output": output.detach().cpu(), "dtype": str(adapter.dtype),
                "weights": {k: tuple(v.shape) for k, v in dm.state_dict().items()}}, out)
    info["forward"] = str(out)
    return info


def probe_lora(model_file: Path, lora_file: Path) -> dict:
    """In a child process: ``lora_file`` loaded by this ComfyUI's own ``LoraLoaderModelOnly`` onto the diffusion
    model of ``model_file`` (built on the meta device from the file's header: no weights read). Counts the LoRA's
    modules, the model weights the loader patched and the LoRA keys it did not load (its own warnings)."""
    import torch

    from ..adapters import injection
    from ..models.loading import META_ARCH, META_UNET, _meta_state_dict, comfy_layout, model_config, read_header
    from ..host.runtime import ensure_comfyui
    from .verify import comfy_lora_model
    from ..host.versions import read_version

    root = ensure_comfyui()
    import comfy.model_detection as md
    import comfy.model_patcher

    shapes, metadata = read_header(model_file)
    if META_UNET in metadata:
        config = model_config(metadata[META_ARCH], json.loads(metadata[META_UNET]))
    else:
        sd = _meta_state_dict(shapes)
        prefix = md.unet_prefix_from_state_dict(sd)   # a checkpoint's diffusion model, as comfy.sd reads it
        sd = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)} or sd
        config = md.model_config_from_unet(sd, "")
        if config is None:   # a Diffusers folder (diffusers_path): ComfyUI's own conversions first
            unet_config, converted = comfy_layout(sd)
            config = md.model_config_from_unet_config(unet_config, converted) if unet_config else None
        if config is None:
            raise RuntimeSetupError(f"{model_file}: ComfyUI {read_version(root)} ({root}) does not recognise this "
                                    f"diffusion model, so its LoRA loader cannot load the run's LoRA")
    config.set_inference_dtype(torch.float32, None)
    model = config.get_model({}, "", device=torch.device("meta"))
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"),
                                               offload_device=torch.device("cpu"))

    unmatched: list[str] = []

    class Unloaded(logging.Handler):   # ComfyUI warns, key by key, about what its loader did not apply
        def emit(self, record):
            text = record.getMessage()
            if text.startswith(("lora key not loaded", "NOT LOADED")):
                unmatched.append(text[:300])

    handler = Unloaded(logging.WARNING)
    logging.getLogger().addHandler(handler)
    try:
        patched = comfy_lora_model(patcher, Path(lora_file))
    finally:
        logging.getLogger().removeHandler(handler)
    modules = {_module_of(k) for k in injection.read_file(Path(lora_file))}
    return {"path": str(root), "version": read_version(root), "modules": len(modules),
            "applied": len(patched.patches), "unmatched": unmatched}


def _module_of(key: str) -> str:
    """The adapted module a saved key belongs to: ``<module>.lora_A.weight``, ``<module>.lokr_w1``,
    ``<module>.alpha`` -> ``<module>``."""
    head, _, last = key.rpartition(".")
    if last == "weight" and head.rpartition(".")[2].startswith("lora_"):
        head = head.rpartition(".")[0]
    return head


def probe_main(what: str, args: list[str]) -> int:
    """``python -m pipetrain comfyui-probe forward TYPE OUT [parity-first]`` / ``... lora MODEL LORA``: one
    probe on the ComfyUI that ``COMFYUI_PATH`` names; prints its result as JSON on the last line."""
    from ..host.runtime import ensure_comfyui

    logging.getLogger().setLevel(logging.ERROR)   # ComfyUI's start-up chatter; the loader's warnings still count
    ensure_comfyui()
    if what == "forward":
        result = probe_forward(args[0], Path(args[1]), parity_first="parity-first" in args[2:])
    else:
        logging.getLogger().setLevel(logging.WARNING)
        result = probe_lora(Path(args[0]), Path(args[1]))
    print(json.dumps(result))
    return 0
