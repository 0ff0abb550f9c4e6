# SPDX-License-Identifier: GPL-3.0-or-later
"""Random-initialised model files in ComfyUI's formats: the real architectures, "tiny" or "full" size.

No weights can be downloaded here, so tests, the demo and benchmarks train on files written by this
module. Every network is ComfyUI's own class (Flux, the SDXL ``UNetModel``, ``AutoencoderKL``,
``CLIPTextModel``, ``T5``) built on the ``meta`` device; the file is then streamed tensor by tensor, so
writing a 12B Flux needs the memory of one tensor, not of the model.

- ``full``: the published configs; ComfyUI detects each file by itself (``comfy.sd.load_diffusion_model``,
  ``comfy.sd.load_clip``, ``comfy.sd.VAE``).
- ``tiny``: Flux-dev at its real width (ComfyUI fixes Flux's heads and rotary axes) with 1 double + 1
  single block, which ComfyUI still detects. SDXL's UNet and the text encoders are ComfyUI's classes with
  small configs that ComfyUI cannot detect, so the config travels in the file's safetensors metadata
  (``pipetrain.unet_config`` / ``pipetrain.te_config``) and ``loading.py`` builds them from it.
  VAEs are always real size (ComfyUI fixes that architecture).

CLI: ``python -m pipetrain.backend.models.tiny ARCH OUT_DIR [--size tiny|full] [--dtype bfloat16]``.
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
from ..fsutil import temp_path_beside

ARCHS = ("flux", "sdxl")
SIZES = ("micro", "tiny", "full")
TINY_FILES_VERSION = "1"   # bump when the files written for a size change
INIT_STD = 0.02

# Flux-dev as ComfyUI detects it (comfy/model_detection.py fixes heads, axes and widths).
FLUX_DEV = {
    "in_channels": 16, "out_channels": 16, "vec_in_dim": 768, "context_in_dim": 4096,
    "hidden_size": 3072, "mlp_ratio": 4.0, "num_heads": 24, "axes_dim": [16, 56, 56], "theta": 10000,
    "patch_size": 2, "qkv_bias": True, "guidance_embed": True,
}
FLUX_DEPTHS = {"micro": (2, 2), "tiny": (1, 1), "full": (19, 38)}  # (double blocks, single blocks)
# "micro": Flux's structure at width 256 (4 heads of 64) for fast multi-step CPU tests; ComfyUI cannot
# detect that width, so its config travels in the file's metadata like the tiny SDXL UNet's.
FLUX_MICRO_WIDTH = {"hidden_size": 256, "num_heads": 4, "axes_dim": [16, 24, 24]}

# The SDXL base UNet exactly as comfy.model_detection derives it from the published weights.
SDXL_UNET_FULL = {
    "use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True,
    "legacy": False, "num_classes": "sequential", "adm_in_channels": 2816, "in_channels": 4,
    "model_channels": 320, "num_res_blocks": [2, 2, 2], "transformer_depth": [0, 0, 2, 2, 10, 10],
    "channel_mult": [1, 2, 4], "transformer_depth_middle": 10, "use_linear_in_transformer": True,
    "context_dim": 2048, "num_head_channels": 64,
    "transformer_depth_output": [0, 0, 0, 2, 2, 2, 10, 10, 10],
    "use_temporal_attention": False, "use_temporal_resblock": False,
}
# Same structure (3 levels, linear transformers, context 2048, adm 2816), small widths and depths.
SDXL_UNET_TINY = {
    **SDXL_UNET_FULL, "model_channels": 32, "num_head_channels": 16, "num_heads": -1,
    "transformer_depth": [0, 0, 1, 1, 1, 1], "transformer_depth_middle": 1,
    "transformer_depth_output": [0, 0, 0, 1, 1, 1, 1, 1, 1],
}

# The KL autoencoder ComfyUI builds for SD-family and Flux VAEs; z_channels comes from the arch.
VAE_DDCONFIG = {
    "double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
    "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0,
}
VAE_LATENT_CHANNELS = {"flux": 16, "sdxl": 4}

# kind -> (ComfyUI's JSON config, relative to its root; tiny overrides). Output widths stay real:
# CLIP-L 768 (Flux's vec_in_dim, SDXL context), CLIP-G 1280 (SDXL context + pooled), T5 4096 (Flux context).
TEXT_ENCODERS = {
    "clip_l": ("comfy/sd1_clip_config.json", {"num_hidden_layers": 3, "intermediate_size": 256}),
    "clip_g": ("comfy/clip_config_bigg.json", {"num_hidden_layers": 3, "intermediate_size": 256}),
    "t5xxl": ("comfy/text_encoders/t5_config_xxl.json", {"num_layers": 2, "num_heads": 4, "d_ff": 256}),
}
ARCH_TEXT_ENCODERS = {"flux": ("clip_l", "t5xxl"), "sdxl": ("clip_l", "clip_g")}

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelFiles:
    diffusion_model: Path
    vae: Path
    text_encoders: list[Path]


# --- networks on the meta device ---------------------------------------------------------------
def _comfy():
    from ..runtime import ensure_comfyui
    ensure_comfyui()
    import comfy.ops
    return comfy


def flux_config(size: str) -> dict:
    depth, single = FLUX_DEPTHS[size]
    width = FLUX_MICRO_WIDTH if size == "micro" else {}
    return {**FLUX_DEV, **width, "depth": depth, "depth_single_blocks": single}


def build_flux(size: str) -> torch.nn.Module:
    comfy = _comfy()
    import comfy.ldm.flux.model
    return comfy.ldm.flux.model.Flux(device="meta", operations=comfy.ops.disable_weight_init,
                                     **flux_config(size))


def sdxl_unet_config(size: str) -> dict:
    return dict(SDXL_UNET_TINY if size in ("micro", "tiny") else SDXL_UNET_FULL)


def build_sdxl_unet(size: str) -> torch.nn.Module:
    comfy = _comfy()
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel
    return UNetModel(**sdxl_unet_config(size), device="meta", operations=comfy.ops.disable_weight_init)


def build_vae(arch: str) -> torch.nn.Module:
    """The module ``comfy.sd.VAE`` builds for this arch's VAE file (same class, same state-dict keys)."""
    _comfy()
    from comfy.ldm.models.autoencoder import AutoencoderKL, AutoencodingEngine
    ddconfig = {**VAE_DDCONFIG, "z_channels": VAE_LATENT_CHANNELS[arch]}
    with torch.device("meta"):
        if arch == "sdxl":  # SD-family VAE files keep quant_conv / post_quant_conv
            return AutoencoderKL(ddconfig=ddconfig, embed_dim=ddconfig["z_channels"])
        part = "comfy.ldm.modules.diffusionmodules.model."
        return AutoencodingEngine(
            regularizer_config={"target": "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer"},
            encoder_config={"target": part + "Encoder", "params": ddconfig},
            decoder_config={"target": part + "Decoder", "params": ddconfig})


def text_encoder_config(kind: str, size: str) -> dict:
    from ..runtime import ensure_comfyui
    rel, tiny = TEXT_ENCODERS[kind]
    config = json.loads((ensure_comfyui() / rel).read_text())
    return {**config, **tiny} if size == "tiny" else config


def build_text_encoder(kind: str, config: dict) -> torch.nn.Module:
    """The module whose state dict is a text-encoder file (``SDClipModel.transformer``)."""
    comfy = _comfy()
    import comfy.clip_model
    import comfy.text_encoders.t5
    cls = comfy.text_encoders.t5.T5 if kind == "t5xxl" else comfy.clip_model.CLIPTextModel
    return cls(config, torch.float32, "meta", comfy.ops.disable_weight_init)


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
            elif is_norm or pname == "scale":
                init = "ones"
            else:
                init = "normal" if p.ndim >= 2 else "zeros"
            plan.append((f"{mname}.{pname}" if mname else pname, tuple(p.shape), init))
    others = sorted(set(module.state_dict(keep_vars=True)) - {key for key, _, _ in plan})
    if others:  # persistent buffers or tied weights: no init rule for them
        raise ModelError(f"{type(module).__name__}: cannot initialise state-dict entries {others[:5]}")
    return plan


def _make_tensor(key: str, shape: tuple, init: str, dtype: torch.dtype, seed: int) -> torch.Tensor:
    if init == "zeros":
        return torch.zeros(shape, dtype=dtype)
    if init == "ones":
        return torch.ones(shape, dtype=dtype)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    return torch.empty(shape).normal_(0.0, INIT_STD, generator=gen).to(dtype)


def _header(plan, dtype: torch.dtype, metadata: dict[str, str]) -> bytes:
    entries, offset = {"__metadata__": metadata}, 0
    item = torch.empty((), dtype=dtype).element_size()
    for key, shape, _ in plan:
        size = item * int(torch.Size(shape).numel())
        entries[key] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(entries, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # tensor data starts 8-byte aligned


def write_safetensors(module: torch.nn.Module, path: Path, dtype: torch.dtype, seed: int,
                      metadata: dict[str, str]) -> int:
    """Write ``module``'s state dict, randomly initialised, one tensor at a time. Returns #parameters."""
    if dtype not in SAFETENSORS_DTYPES:
        raise ModelError(f"{path}: cannot write dtype {dtype}; use one of {sorted(DTYPE_NAMES)}")
    plan = tensor_plan(module)
    header = _header(plan, dtype, metadata)
    tmp = temp_path_beside(path)
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for key, shape, init in plan:
                f.write(_make_tensor(key, shape, init, dtype, seed).reshape(-1).view(torch.uint8).numpy())
        os.chmod(tmp, 0o644)  # mkstemp made it private; a model file is an ordinary file
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return sum(int(torch.Size(shape).numel()) for _, shape, _ in plan)


# --- the files for one architecture --------------------------------------------------------------
def _write_diffusion_model(arch: str, size: str, path: Path, dtype, seed) -> int:
    meta = {"pipetrain.arch": arch, "pipetrain.size": size}
    if arch == "flux":
        module = build_flux(size)
        if size == "micro":
            meta["pipetrain.unet_config"] = json.dumps(flux_config(size))
    else:
        module = build_sdxl_unet(size)
        if size in ("micro", "tiny"):  # ComfyUI matches only the published SDXL config: say what this is
            meta["pipetrain.unet_config"] = json.dumps(sdxl_unet_config(size))
    return write_safetensors(module, path, dtype, seed, meta)


def _write_text_encoder(kind: str, size: str, path: Path, dtype, seed) -> int:
    size = "tiny" if size == "micro" else size
    config = text_encoder_config(kind, size)
    meta = {"pipetrain.te_kind": kind, "pipetrain.size": size}
    if size == "tiny":
        meta["pipetrain.te_config"] = json.dumps(config)
    return write_safetensors(build_text_encoder(kind, config), path, dtype, seed, meta)


def write_model_files(arch: str, out_dir: Path, size: str = "tiny", dtype=torch.float32, seed=0) -> ModelFiles:
    """Write a random-initialised diffusion model, VAE and text encoders for ``arch`` into ``out_dir``."""
    if arch not in ARCHS or size not in SIZES:
        raise ModelError(f"unknown arch/size {arch!r}/{size!r}; supported: {ARCHS} x {SIZES}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = ModelFiles(out_dir / f"{arch}_{size}_diffusion_model.safetensors",
                       out_dir / f"{arch}_vae.safetensors",
                       [out_dir / f"{arch}_{size}_{kind}.safetensors" for kind in ARCH_TEXT_ENCODERS[arch]])
    _write_diffusion_model(arch, size, files.diffusion_model, dtype, seed)
    write_safetensors(build_vae(arch), files.vae, dtype, seed + 1, {"pipetrain.arch": arch})
    for i, (kind, path) in enumerate(zip(ARCH_TEXT_ENCODERS[arch], files.text_encoders)):
        _write_text_encoder(kind, size, path, dtype, seed + 2 + i)
    return files


def cached_model_files(arch: str, size: str = "tiny", root: Path | None = None) -> ModelFiles:
    """Model files written once and shared by the demo and the tests (``.work/tiny-models`` in the repo).
    A ``complete`` marker is written last, so an interrupted write is redone, never half-used."""
    from ..runtime import REPO_ROOT

    folder = (root or REPO_ROOT / ".work" / "tiny-models") / f"{arch}-{size}-v{TINY_FILES_VERSION}"
    marker = folder / "complete"
    if marker.is_file():
        data = json.loads(marker.read_text())
        return ModelFiles(Path(data["diffusion_model"]), Path(data["vae"]), [Path(p) for p in data["text_encoders"]])
    files = write_model_files(arch, folder, size)
    marker.write_text(json.dumps({"diffusion_model": str(files.diffusion_model), "vae": str(files.vae),
                                  "text_encoders": [str(p) for p in files.text_encoders]}))
    return files


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
