"""The manifest maps each training example to its cache keys; it is rebuilt from the files on every run
unless the user asks to trust the previous one (``--trust-cache``)."""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from ..errors import CacheError
from ..fsutil import atomic_write_bytes
from .keys import caption_image, file_digest, latent_key, model_fingerprint, text_key

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheEntry:
    path: str
    bucket: tuple[int, int]
    caption: str
    num_repeats: int
    latent: str
    text: str
    control: str = ""     # edit models: the paired control image
    more_controls: tuple[str, ...] = ()   # multi-reference edit models: the further control images, in order
    is_reg: bool = False  # a regularisation image (an is_reg directory's)
    mask: str = ""        # masked training: the mask image, stored with the latent (its digest in the latent key)
    control_mask: str = ""   # wan_vace: the control mask (its digest in the latent key)
    reference: str = ""      # wan_vace: the reference image (its digest in the latent key)
    lyrics: str = ""      # audio models: the song's lyrics, encoded with the caption (in the text key)
    digest: str = ""      # the SHA-256 of ``path`` its latent key was made with: what is encoded must match it


@dataclass
class CacheManifest:
    arch: str
    entries: list[CacheEntry]

    def save(self, path: Path) -> None:
        # one line, without indentation: json's C encoder writes it (indenting takes its Python encoder, several
        # seconds for a large dataset); an entry's fields are plain values, so a shallow copy is its dict
        data = {"arch": self.arch, "entries": [dict(vars(e)) for e in self.entries]}
        atomic_write_bytes(path, json.dumps(data, sort_keys=True, separators=(",", ":")).encode())

    @classmethod
    def load(cls, path: Path) -> "CacheManifest":
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise CacheError(f"no cache manifest at {path}: --trust-cache needs a previous cache run; "
                             "run without it once") from None
        entries = [CacheEntry(**{**e, "bucket": tuple(e["bucket"]), "more_controls": tuple(e.get("more_controls", ()))})
                   for e in data["entries"]]
        return cls(arch=data["arch"], entries=entries)


def manifest_path(cache_dir: Path, dataset_file: Path, arch: str) -> Path:
    tag = hashlib.sha256(str(dataset_file.resolve()).encode()).hexdigest()[:16]
    return cache_dir / "manifests" / f"{arch}-{tag}.json"


def build_entries(examples, adapter, files: dict[str, list[Path]], fingerprint=model_fingerprint) -> list[CacheEntry]:
    """``fingerprint``: a model file's identity (``CacheStore.fingerprint`` remembers the digests)."""
    from ..data import PREPROCESS_VERSION
    from ..data.audio import AUDIO_PREPROCESS_VERSION
    from ..data.video import VIDEO_PREPROCESS_VERSION
    VIDEO_PREPROCESS = f"{PREPROCESS_VERSION}/video{VIDEO_PREPROCESS_VERSION}"

    vae_fp = fingerprint(files["vae"][0])
    te_fps = [fingerprint(p) for p in files["text_encoders"]]
    # files only the conditioning is encoded with (e.g. Wan 2.1 i2v's CLIP vision)
    cond_models = {"models": [fingerprint(p) for p in files["conditioning"]]} if files.get("conditioning") else {}
    digests: dict[Path, str] = {}
    entries = []
    for s in examples:
        path = s.item.path
        control, mask, more = s.item.control, s.item.mask, s.item.more_controls
        vace = {k: getattr(s.item, k) for k in ("control_mask", "reference") if getattr(s.item, k) is not None}
        for p in (path, control, mask, *more, *vace.values()):
            if p is not None and p not in digests:
                digests[p] = file_digest(p)
        text = getattr(s, "text", s.item.caption)   # the caption variant this example trains on
        audio = getattr(adapter, "audio", False)
        preprocess = AUDIO_PREPROCESS_VERSION if audio else \
            PREPROCESS_VERSION if len(s.bucket) == 2 else VIDEO_PREPROCESS
        more_digests = [digests[p] for p in more]
        # the further controls' digests only where there are some: single-control keys stay as they were
        conditioning = {"fields": list(adapter.conditioning_fields), "control": digests[control] if control else None,
                        **({"more_controls": more_digests} if more else {}),
                        **{k: digests[p] for k, p in vace.items()}, **getattr(adapter, "conditioning_options", dict)(),
                        **cond_models} if adapter.conditioning_fields else None
        entries.append(CacheEntry(
            path=str(path), bucket=tuple(s.bucket), caption=text, num_repeats=s.item.num_repeats,
            latent=latent_key(digests[path], s.bucket, preprocess, vae_fp, adapter.arch, adapter.latent_format, conditioning,
                              mask=digests[mask] if mask else None),
            text=text_key(text, te_fps, adapter.arch,
                          caption_image(adapter, digests.get(control), s.bucket, more_digests),
                          lyrics=s.item.lyrics if audio else None, options=adapter.text_options()),
            control=str(control) if control else "", more_controls=tuple(map(str, more)), is_reg=s.item.is_reg,
            mask=str(mask) if mask else "", **{k: str(p) for k, p in vace.items()},
            lyrics=s.item.lyrics if audio else "", digest=digests[path]))
    return entries


def build_or_load_manifest(path: Path, examples_fn, adapter, files, trust_cache: bool,
                           fingerprint=model_fingerprint) -> CacheManifest:
    if trust_cache:
        log.info("trusting the cache manifest %s without re-reading the dataset", path)
        return CacheManifest.load(path)
    manifest = CacheManifest(arch=adapter.arch, entries=build_entries(examples_fn(), adapter, files, fingerprint))
    manifest.save(path)
    return manifest
