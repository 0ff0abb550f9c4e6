# SPDX-License-Identifier: GPL-3.0-or-later
"""Random-initialised model files in ComfyUI's formats: the real architectures, "micro", "tiny" or "full".

No weights can be downloaded here, so tests, the demo and benchmarks train on files written by this
module. Every network is ComfyUI's own class (Flux, the SDXL ``UNetModel``, ``AutoencoderKL``,
``CLIPTextModel``, ``T5``, ...) built on the ``meta`` device; the file is then streamed tensor by tensor,
so writing a 12B model needs the memory of one tensor, not of the model.

What each architecture's files are -- its diffusion-model config per size, text encoders and VAE -- is
its adapter's ``spec`` (``spec.py``) with the text-encoder and VAE kinds of ``encoders.py`` / ``vaes.py``, and
tokenizers ComfyUI does not ship come from ``tiny_tokenizers.py``; nothing here names an architecture.

- ``full``: the published configs; ComfyUI detects each file by itself (``comfy.sd.load_diffusion_model``,
  ``comfy.sd.load_clip``, ``comfy.sd.VAE``).
- ``tiny`` / ``micro``: small configs. Where ComfyUI's detection still recognises one (``spec.detected_sizes``,
  e.g. Flux-dev at its real width with 1 double + 1 single block) the file is plain; where it pins widths
  it cannot see (SDXL's UNet, narrow Flux, text encoders) the config travels in the file's safetensors
  metadata (``pipetrain.unet_config`` / ``pipetrain.te_config``), which ``loading.py`` gives ComfyUI's
  loading (see there). KL VAEs are always real size (ComfyUI fixes that architecture); the Wan VAE reads its width.

CLI: ``python -m pipetrain.backend.models.tiny ARCH OUT_DIR [--size micro|tiny|full] [--dtype bfloat16]``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ModelError
from ..fsutil import exclusive, temp_path_beside, user_cache_dir
from .registry import ADAPTERS, arch_spec
from . import encoders, vaes
from .spec import SIZES

ARCHS = tuple(ADAPTERS)
TINY_FILES_VERSION = "3"   # bump when the files written for a size change (3: the tiny ACE vocoder decodes)
INIT_STD = 0.02

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.uint8: "U8"}
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelFiles:
    diffusion_model: Path
    vae: Path
    text_encoders: list[Path]


# --- networks on the meta device ---------------------------------------------------------------
def build_diffusion_model(arch: str, size: str) -> torch.nn.Module:
    spec = arch_spec(arch)
    return spec.build_host(spec.unet_config(size))


def build_vae(arch: str, size: str = "tiny") -> torch.nn.Module:
    """The module ``comfy.sd.VAE`` builds for this arch's VAE file (same class, same state-dict keys)."""
    return vaes.kind(arch_spec(arch).vae).build(size)


SHALLOW = "shallow"   # text encoders for benchmarks: the real width (what the diffusion model reads), tiny depth


def text_encoder_config(kind: str, size: str) -> dict:
    from ..host.runtime import locate_comfyui
    spec = encoders.kind(kind)
    config = spec.config() if callable(spec.config) else json.loads((locate_comfyui() / spec.config).read_text())
    if size == SHALLOW:
        return {**config, **{key: value for key, value in spec.tiny.items() if "layers" in key}}
    return {**config, **spec.tiny} if size == "tiny" else config


def build_text_encoder(kind: str, config: dict) -> torch.nn.Module:
    """The module whose state dict is a text-encoder file (``SDClipModel.transformer``)."""
    return encoders.kind(kind).build(config)


# --- streaming a meta module to safetensors ------------------------------------------------------
def tensor_plan(module: torch.nn.Module) -> list[tuple[str, tuple, str]]:
    """(state-dict key, shape, init) for every tensor of ``module``, in state-dict order."""
    plan, seen = [], set()
    for mname, sub in module.named_modules():
        is_norm = "Norm" in type(sub).__name__
        for pname, p in sub.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if pname == "bias":
                init = "zeros"
            elif is_norm or pname in ("scale", "gamma"):
                init = "ones"
            else:
                init = "normal" if p.ndim >= 2 else "zeros"
            plan.append((f"{mname}.{pname}" if mname else pname, tuple(p.shape), init))
        for bname, b in sub.named_buffers(recurse=False):  # persistent ones only (e.g. a position table)
            if bname not in sub._non_persistent_buffers_set and id(b) not in seen and b.is_floating_point():
                seen.add(id(b))
                plan.append((f"{mname}.{bname}" if mname else bname, tuple(b.shape), "normal"))
    others = sorted(set(module.state_dict(keep_vars=True)) - {key for key, _, _ in plan})
    if others:  # tied weights or integer buffers: no init rule for them
        raise ModelError(f"{type(module).__name__}: cannot initialise state-dict entries {others[:5]}")
    return plan


def _make_tensor(key: str, shape: tuple, init: str, dtype: torch.dtype, seed: int,
                 device: str = "cpu") -> torch.Tensor:
    """One initialised tensor on the CPU; the random draw happens on ``device`` (a GPU draws a 12B model in
    seconds; values then differ from the CPU's for the same seed). ``init``: zeros, ones, normal (std ``INIT_STD``),
    ``normal:<std>`` or ``fan_in`` (std 1 / sqrt(the weight's inputs): a deep stack keeps its signal's size)."""
    if init == "zeros":
        return torch.zeros(shape, dtype=dtype)
    if init == "ones":
        return torch.ones(shape, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    fan_in = int(torch.Size(shape[1:]).numel()) or 1
    std = fan_in ** -0.5 if init == "fan_in" else float(init.partition(":")[2] or INIT_STD)
    return torch.empty(shape, device=device).normal_(0.0, std, generator=gen).to(dtype).cpu()


def _header(plan, dtype: torch.dtype, metadata: dict[str, str], extras: dict[str, torch.Tensor]) -> bytes:
    entries, offset = {"__metadata__": metadata}, 0
    item = torch.empty((), dtype=dtype).element_size()
    rows = [(key, shape, dtype, item) for key, shape, _ in plan]
    rows += [(key, tuple(t.shape), t.dtype, t.element_size()) for key, t in extras.items()]
    for key, shape, dt, itemsize in rows:
        size = itemsize * int(torch.Size(shape).numel())
        entries[key] = {"dtype": SAFETENSORS_DTYPES[dt], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(entries, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # tensor data starts 8-byte aligned


def _init_rule(key: str, rule: str, init: dict[str, str]) -> str:
    """``init``'s rule for ``key``: its own, else that of a prefix ending in "." (a whole submodule), for the
    weights the generic rule draws at random (biases and norms keep theirs)."""
    if key in init:
        return init[key]
    prefixes = [p for p in init if p.endswith(".") and key.startswith(p)]
    return init[max(prefixes, key=len)] if prefixes and rule.startswith("normal") else rule


def write_safetensors(module: torch.nn.Module, path: Path, dtype: torch.dtype, seed: int,
                      metadata: dict[str, str], extras: dict[str, torch.Tensor] | None = None,
                      device: str = "cpu", init: dict[str, str] | None = None) -> int:
    """Write ``module``'s state dict, randomly initialised, one tensor at a time, then ``extras`` as they are
    (e.g. a tokenizer stored in the file). ``init``: key -> init rule overriding the generic one.
    Returns #parameters of the module."""
    if dtype not in DTYPE_NAMES.values():
        raise ModelError(f"{path}: cannot write dtype {dtype}; use one of {sorted(DTYPE_NAMES)}")
    extras = extras or {}
    plan = [(key, shape, _init_rule(key, rule, init or {})) for key, shape, rule in tensor_plan(module)]
    header = _header(plan, dtype, metadata, extras)
    tmp = temp_path_beside(path)
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for key, shape, init in plan:
                f.write(_make_tensor(key, shape, init, dtype, seed, device).reshape(-1).view(torch.uint8).numpy())
            for t in extras.values():
                f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy())
        os.chmod(tmp, 0o644)  # mkstemp made it private; a model file is an ordinary file
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return sum(int(torch.Size(shape).numel()) for _, shape, _ in plan)


# --- the files for one architecture --------------------------------------------------------------
def _write_diffusion_model(arch: str, size: str, path: Path, dtype, seed, device: str = "cpu",
                           unet_config: dict | None = None) -> int:
    spec = arch_spec(arch)
    config = unet_config or spec.unet_config(size)
    meta = {"pipetrain.arch": arch, "pipetrain.size": size}
    if size not in spec.detected_sizes:  # ComfyUI cannot tell this config from the weights: say what it is
        meta["pipetrain.unet_config"] = json.dumps(config)
    module = spec.build_host(config)
    return write_safetensors(module, path, dtype, seed, meta, device=device, init=spec.diffusion_model_init)


def _write_text_encoder(kind: str, size: str, path: Path, dtype, seed, device: str = "cpu",
                        reads_images: bool = False) -> int:
    size = "tiny" if size == "micro" else size
    config = text_encoder_config(kind, size)
    meta = {"pipetrain.te_kind": kind, "pipetrain.size": size}
    if size in ("tiny", SHALLOW):
        meta["pipetrain.te_config"] = json.dumps(config)
    extras = {name: make() for name, make in encoders.kind(kind).extras.items()}
    module = build_text_encoder(kind, config)
    # e.g. a VL model's vision tower: text-only encoding never runs it
    if size in ("tiny", SHALLOW) and not reads_images:
        for name in encoders.kind(kind).tiny_omits:
            delattr(module, name)
    return write_safetensors(module, path, dtype, seed, meta, extras, device)


def _vae_metadata(kind: str, size: str) -> dict[str, str]:
    """A VAE whose width ComfyUI fixes (``VAEKind.widths``): a narrower file names its widths for loading.py."""
    widths = vaes.kind(kind).widths(size) if vaes.kind(kind).widths else {}
    meta = {"pipetrain.vae_kind": kind, "pipetrain.vae_config": json.dumps(widths)} if widths else {}
    if vaes.kind(kind).file_metadata:   # what ComfyUI reads from the file itself (e.g. the LTX VAE's config)
        meta.update(vaes.kind(kind).file_metadata(size))
    return meta


def write_model_files(arch: str, out_dir: Path, size: str = "tiny", dtype=torch.float32, seed=0, *,
                      text_encoder_size: str | None = None, init_device: str = "cpu",
                      unet_config: dict | None = None) -> ModelFiles:
    """Write a random-initialised diffusion model, VAE and text encoders for ``arch`` into ``out_dir``.

    ``text_encoder_size`` (default ``size``): benchmarks pair a full diffusion model with ``"shallow"`` text
    encoders (a few layers at the real width), so the training step is the full-size one. ``unet_config``: another
    published size of the architecture (e.g. Wan 2.1 1.3B) in place of ``size``'s, written as ``size``."""
    if arch not in ARCHS or size not in SIZES:
        raise ModelError(f"unknown arch/size {arch!r}/{size!r}; supported: {ARCHS} x {SIZES}")
    spec = arch_spec(arch)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vae = vaes.kind(spec.vae)
    files = ModelFiles(out_dir / f"{arch}_{size}_diffusion_model.safetensors",
                       out_dir / (f"{arch}_{size}_vae.safetensors" if vae.sized else f"{arch}_vae.safetensors"),
                       [out_dir / f"{arch}_{text_encoder_size or size}_{kind}.safetensors"
                        for kind in spec.text_encoders])
    _write_diffusion_model(arch, size, files.diffusion_model, dtype, seed, init_device, unet_config)
    # VAEs and text encoders are seeded by their kind, not their place in the architecture, so the same
    # component is the same file in every architecture (the shared cache stores it once)
    write_safetensors(vae.build(size), files.vae, dtype, seed + 1, _vae_metadata(spec.vae, size),
                      {name: make() for name, make in vae.extras.items()}, device=init_device,
                      init=vae.init)
    for kind, path in zip(spec.text_encoders, files.text_encoders):
        _write_text_encoder(kind, text_encoder_size or size, path, dtype, seed + 2 + zlib.crc32(kind.encode()) % 997,
                            init_device, spec.text_encoders_read_images)
    return files


def write_checkpoint(arch: str, path: Path, size: str = "tiny", dtype=torch.float32, seed: int = 0) -> Path:
    """An all-in-one checkpoint (diffusion model, VAE and text encoders in one file, what CheckpointLoaderSimple
    reads from models/checkpoints) of the same weights ``write_model_files`` writes for these arguments: those files
    loaded through ComfyUI and saved by ComfyUI's own ``comfy.sd.save_checkpoint`` (the CheckpointSave node's
    layout, e.g. ``model.diffusion_model.*``, ``first_stage_model.*`` / ``vae.*``, ``cond_stage_model.*`` /
    ``text_encoders.*``: the model's ComfyUI config decides). The separate files' metadata travels along, the text
    encoders' configs by kind (``checkpoint_file.META_TE_CONFIGS``)."""
    import tempfile

    from ..host.runtime import ensure_comfyui
    from .checkpoint_file import META_TE_CONFIGS
    from .loading import META_TE, META_TE_KIND, load_diffusion_model, load_text_encoders, load_vae, read_header

    ensure_comfyui()
    import comfy.sd

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        files = write_model_files(arch, Path(tmp), size, dtype, seed)
        metadata, te_configs = {}, {}
        for part in (files.diffusion_model, files.vae):
            metadata.update(read_header(part)[1])
        for part in files.text_encoders:
            meta = read_header(part)[1]
            if META_TE in meta:
                te_configs[meta[META_TE_KIND]] = json.loads(meta[META_TE])
        if te_configs:
            metadata[META_TE_CONFIGS] = json.dumps(te_configs)
        patcher = load_diffusion_model(files.diffusion_model, dtype, arch=arch)
        clip = load_text_encoders(files.text_encoders, arch, dtype)
        out = temp_path_beside(path)
        comfy.sd.save_checkpoint(str(out), patcher, clip, load_vae(files.vae), metadata=metadata)
        os.chmod(out, 0o644)   # mkstemp made it private; a model file is an ordinary file
        os.replace(out, path)
    return path


def write_clip_vision(path: Path, size: str = "tiny", dtype=torch.float32, seed: int = 0) -> int:
    """A CLIP-vision file (ViT-H/14, as Wan 2.1 i2v takes); tiny ones carry their config in the metadata."""
    from ..host.runtime import locate_comfyui
    from .encoders import CLIP_VISION_H_CONFIG, CLIP_VISION_TINY, clip_vision_model
    config = json.loads((locate_comfyui() / CLIP_VISION_H_CONFIG).read_text())
    meta = {"pipetrain.size": size}
    if size != "full":
        config = {**config, **CLIP_VISION_TINY}
        meta["pipetrain.clip_vision_config"] = json.dumps(config)
    return write_safetensors(clip_vision_model(config), Path(path), dtype, seed, meta)


TINY_MODELS_ENV = "PIPETRAIN_TINY_MODELS"


def tiny_models_root() -> Path:
    """Where ``cached_model_files`` keeps its files: ``PIPETRAIN_TINY_MODELS``, else ``tiny-models`` in PipeTrain's
    folder of the user's cache, so every checkout on a machine (a CI's fresh one too) writes them once."""
    return Path(os.environ.get(TINY_MODELS_ENV) or user_cache_dir() / "tiny-models")


def cached_model_files(arch: str, size: str = "tiny", root: Path | None = None) -> ModelFiles:
    """Model files written once per machine and shared by the demo and the tests (``tiny_models_root``); a change
    to the files written bumps ``TINY_FILES_VERSION``, the folders' suffix.
    A ``complete`` marker is written last, so an interrupted write is redone, never half-used. It names the files
    relative to the folder, so a moved or linked ``.work`` still finds them. Identical VAE and text-encoder files
    of different architectures are one file on disk (hard links into ``blobs/``): the cache must not fill the disk
    it shares with the runs."""
    root = root or tiny_models_root()
    folder = root / f"{arch}-{size}-v{TINY_FILES_VERSION}"
    with exclusive(root / f".{folder.name}.writing"):
        return _cached_model_files(arch, size, root, folder)


def _cached_model_files(arch: str, size: str, root: Path, folder: Path) -> ModelFiles:
    marker = folder / "complete"
    if marker.is_file():
        data = json.loads(marker.read_text())
        def here(name: str) -> Path:
            return folder / Path(name).name
        return ModelFiles(here(data["diffusion_model"]), here(data["vae"]), [here(p) for p in data["text_encoders"]])
    files = write_model_files(arch, folder, size)
    for path in (files.vae, *files.text_encoders):
        _share_identical(path, root / "blobs")
    marker.write_text(json.dumps({"diffusion_model": files.diffusion_model.name, "vae": files.vae.name,
                                  "text_encoders": [p.name for p in files.text_encoders]}))
    return files


def _share_identical(path: Path, blobs: Path) -> None:
    """Replace ``path`` by a hard link to the blob of the same content (or make it that blob). Where links are
    not possible (another file system), the file simply stays as it is."""
    import hashlib
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    blob = blobs / f"{digest.hexdigest()}.safetensors"
    blobs.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        if blob.is_file() and not os.path.samefile(blob, path):   # (renaming a link onto itself does nothing)
            link = path.with_name(f".{path.name}.{os.getpid()}.link")
            link.unlink(missing_ok=True)
            os.link(blob, link)
            os.replace(link, path)
        elif not blob.is_file():
            os.link(path, blob)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipetrain.backend.models.tiny",
                                     description="Write random-initialised model files in ComfyUI's formats.")
    parser.add_argument("arch", choices=ARCHS)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    files = write_model_files(args.arch, args.out_dir, args.size, DTYPE_NAMES[args.dtype], args.seed)
    print(f"diffusion_model: {files.diffusion_model}")
    print(f"vae: {files.vae}")
    for path in files.text_encoders:
        print(f"text_encoder: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
