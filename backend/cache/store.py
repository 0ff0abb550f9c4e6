"""On-disk store: one safetensors file per key, fanned out by the key's first two hex digits."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import CacheError
from ..fsutil import temp_path_beside


class CacheStore:
    def __init__(self, root: Path):
        self.root = Path(root)

    def path(self, kind: str, key: str) -> Path:
        return self.root / kind / key[:2] / f"{key}.safetensors"

    def has(self, kind: str, key: str) -> bool:
        return self.path(kind, key).is_file()

    def put(self, kind: str, key: str, tensors: dict[str, torch.Tensor]) -> None:
        final = self.path(kind, key)
        tmp = temp_path_beside(final)
        try:
            save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(tmp))
            tmp.replace(final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def get(self, kind: str, key: str) -> dict[str, torch.Tensor]:
        p = self.path(kind, key)
        try:
            return load_file(str(p))
        except FileNotFoundError:
            raise CacheError(f"cache entry missing: {p}; run `python -m pipetrain cache CONFIG` "
                             "(or train without --trust-cache)") from None

    def clear(self) -> None:
        for kind in ("latents", "text"):
            shutil.rmtree(self.root / kind, ignore_errors=True)
