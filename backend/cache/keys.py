"""Cache keys: hashes over every input that determines a cached tensor."""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

CACHE_FORMAT = 1          # bump when the stored layout or the encoding code changes
_SAMPLE_BYTES = 1 << 20


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def file_digest(path: Path) -> str:
    """SHA-256 of a dataset file's bytes (images are small; this is the identity of the content)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def model_fingerprint(path: Path) -> str:
    """Identity of a (multi-GB) model file without reading all of it: its size, mtime, safetensors
    header (every tensor's name, dtype, shape and offset) and its first and last MiB."""
    st = path.stat()
    h = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}".encode())
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) == 8:
            (n,) = struct.unpack("<Q", head)
            if 0 < n < 100 << 20:
                h.update(f.read(n))
        f.seek(0)
        h.update(f.read(_SAMPLE_BYTES))
        if st.st_size > _SAMPLE_BYTES:
            f.seek(max(0, st.st_size - _SAMPLE_BYTES))
            h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


def latent_key(image_digest: str, bucket: tuple[int, int], preprocess_version: str, vae_fingerprint: str,
               arch: str, latent_format: str, conditioning: dict | None = None) -> str:
    """``conditioning`` (edit and i2v models): the cached conditioning fields and the control image's digest,
    which are stored with the latent."""
    extra = {} if conditioning is None else {"conditioning": conditioning}
    return _sha({"kind": "latent", "format": CACHE_FORMAT, "image": image_digest, "bucket": list(bucket),
                 "preprocess": preprocess_version, "vae": vae_fingerprint, "arch": arch,
                 "latent_format": latent_format, **extra})


def text_key(caption: str, te_fingerprints: list[str], arch: str, image: dict | None = None) -> str:
    """``image``: what of a control image the text encoder reads with the caption (``caption_image``)."""
    extra = {} if image is None else {"image": image}
    return _sha({"kind": "text", "format": CACHE_FORMAT, "caption": caption, "te": te_fingerprints, "arch": arch,
                 **extra})


def caption_image(adapter, control_digest: str | None, bucket) -> dict | None:
    """For models whose text encoder reads the control image with the caption: the image's digest and the
    bucket it is cropped to (the embedding depends on both); None for every other model or sample."""
    if not (adapter.caption_sees_control and control_digest):
        return None
    return {"control": control_digest, "bucket": list(bucket[:2])}
