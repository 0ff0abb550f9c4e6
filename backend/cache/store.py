"""On-disk store: one safetensors file per key, fanned out by the key's first two hex digits. Each file carries
the SHA-256 of its tensors (names, dtypes, shapes and bytes) in its metadata, checked on every read: a damaged
entry is never trained on."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save_file

from ..errors import CacheError
from ..fsutil import WRITES, fault_point, space_guard, temp_path_beside

SUFFIX = ".safetensors"
DIGEST = "pipetrain.sha256"   # the metadata key of an entry's digest

log = logging.getLogger("pipetrain")


class DamagedCacheEntry(CacheError):
    def __init__(self, path: Path, what: str):
        super().__init__(f"cache entry {path} {what}: train with --regenerate-cache to encode the cache again, or "
                         "delete that file to encode it alone")
        self.path, self.what = path, what


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}\0{t.dtype}\0{list(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


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
        with WRITES:
            self._put(kind, final, tensors)

    def _put(self, kind: str, final: Path, tensors: dict[str, torch.Tensor]) -> None:
        tmp = temp_path_beside(final)
        with space_guard(self.root, tmp):
            try:
                host = {k: v.contiguous().cpu() for k, v in tensors.items()}
                save_file(host, str(tmp), metadata={DIGEST: tensors_digest(host)})
                fault_point(f"cache-written:{kind}")
                tmp.replace(final)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise

    def get(self, kind: str, key: str, encode_again: Callable[[], None] | None = None,
            needs: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
        """The entry's tensors, read once and checked against their digest (and for the ``needs`` names). A damaged
        one: with ``encode_again`` (which stores the entry anew) it is encoded again with a warning naming the file,
        and read back; without, ``DamagedCacheEntry``."""
        try:
            return self._checked(kind, key, needs)
        except DamagedCacheEntry as e:
            if encode_again is None:
                raise
            log.warning("cache entry %s %s: encoding it again", e.path, e.what)
            # replaced, not removed first: another rank reading the same entry meanwhile (the first and last
            # pipeline stages both read each latent) finds the damaged file and encodes it too, never none
            encode_again()
            return self._checked(kind, key, needs)

    def _checked(self, kind: str, key: str, needs: tuple[str, ...]) -> dict[str, torch.Tensor]:
        p = self.path(kind, key)
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            raise CacheError(f"cache entry missing: {p}; run `python -m pipetrain cache CONFIG` "
                             "(or train without --trust-cache)") from None
        try:
            tensors = load(data)
            metadata = _metadata(data)
        except (SafetensorError, ValueError, RuntimeError):
            raise DamagedCacheEntry(p, "cannot be read (cut short or damaged)") from None
        want = metadata.get(DIGEST)
        if want is not None and want != tensors_digest(tensors):   # entries written before digests: unchecked
            raise DamagedCacheEntry(p, "differs from what was encoded (its SHA-256 does not match)")
        missing = [name for name in needs if name not in tensors]
        if missing:
            raise DamagedCacheEntry(p, f"holds no {missing[0]!r} tensor")
        return tensors

    def clear(self) -> None:
        for kind in ("latents", "text"):
            shutil.rmtree(self.root / kind, ignore_errors=True)


def _metadata(data: bytes) -> dict:
    """A safetensors file's ``__metadata__`` (its header is JSON after an 8-byte length)."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    metadata = header.get("__metadata__") or {}
    return metadata if isinstance(metadata, dict) else {}
