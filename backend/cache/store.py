"""On-disk store: one safetensors file per key, fanned out by the key's first two hex digits."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import CacheError
from ..fsutil import space_guard, temp_path_beside

SUFFIX = ".safetensors"


class CacheStore:
    def __init__(self, root: Path):
        self.root = Path(root)

    def fingerprint(self, model_file: Path) -> str:
        """``keys.model_fingerprint`` with its digests remembered in this cache folder."""
        from .keys import model_fingerprint
        return model_fingerprint(Path(model_file), self.root / "model-digests.json")

    def path(self, kind: str, key: str) -> Path:
        return self.root / kind / key[:2] / f"{key}{SUFFIX}"

    def has(self, kind: str, key: str) -> bool:
        return self.path(kind, key).is_file()

    def keys(self, kind: str) -> set[str]:
        """Every key stored of ``kind``: one directory listing per fan-out folder instead of a lookup per key."""
        found = set()
        try:
            folders = [e.path for e in os.scandir(self.root / kind) if e.is_dir()]
        except FileNotFoundError:
            return found
        for folder in folders:
            fan = os.path.basename(folder)   # a key's file lies in the folder of its first two digits only
            with os.scandir(folder) as entries:
                found.update(e.name[:-len(SUFFIX)] for e in entries
                             if e.name.endswith(SUFFIX) and e.name.startswith(fan) and e.is_file())
        return found

    def put(self, kind: str, key: str, tensors: dict[str, torch.Tensor]) -> None:
        final = self.path(kind, key)
        tmp = temp_path_beside(final)
        with space_guard(self.root, tmp):
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
