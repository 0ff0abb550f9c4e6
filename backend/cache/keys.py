"""Cache keys: hashes over every input that determines a cached tensor."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..fsutil import atomic_write_json, user_cache_dir

CACHE_FORMAT = 1          # bump when the stored layout or the encoding code changes


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def file_digest(path: Path) -> str:
    """SHA-256 of a dataset file's bytes (images are small; this is the identity of the content)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def model_fingerprint(path: Path, memo: Path | None = None) -> str:
    """SHA-256 of a model file's whole content: any changed byte changes every key built on it (a copy that
    keeps size, header, ends and mtime, as ``cp -p``, ``rsync -a`` or tar make, included). Multi-GB files are
    read once: ``memo`` (a JSON file in the cache folder) keeps each digest under the file's device, inode,
    size, mtime and ctime, and any write to the file or a file put in its place changes the ctime.

    The user's cache folder keeps the same digests (``model-digests.json``, ``PIPETRAIN_DIGEST_CACHE`` names another
    folder), so a run with a new output folder does not read the files again either.

    A model folder (a Diffusers component, an official checkpoint folder) is the digest over each file that
    decides what loads from it (every weight shard and JSON config, ``model_folders.fingerprint_files``) with its
    name: editing, adding or renaming a shard changes it."""
    if path.is_dir():
        from ..config.model_folders import fingerprint_files
        return _sha([[p.relative_to(path).as_posix(), model_fingerprint(p, memo)]
                     for p in fingerprint_files(path)])
    st = path.stat()
    identity = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    name = str(path.resolve())
    user = _user_memo()
    for m in (memo, user):
        digest = _remembered(_read_memo(m), name, identity)
        if digest is not None:
            if m is user and memo is not None:
                _remember(memo, name, identity, digest)
            return digest
    digest = file_digest(path)
    if memo is not None:
        _remember(memo, name, identity, digest)
    try:
        _remember(user, name, identity, digest)
    except OSError:   # the user's cache folder only saves time: a read-only or full home never stops a run
        pass
    return digest


def _user_memo() -> Path:
    return Path(os.environ.get("PIPETRAIN_DIGEST_CACHE") or user_cache_dir()) / "model-digests.json"


def _remembered(known: dict, name: str, identity: list) -> str | None:
    entry = known.get(name)
    if not isinstance(entry, dict) or entry.get("stat") != identity:
        return None
    digest = entry.get("sha256")
    return digest if isinstance(digest, str) and len(digest) == 64 and set(digest) <= HEX else None


def _remember(memo: Path, name: str, identity: list, digest: str) -> None:
    known = _read_memo(memo)   # another rank or run may have added files meanwhile
    known = {k: v for k, v in known.items() if os.path.exists(k)}   # files gone (moved, deleted) are forgotten
    known[name] = {"stat": identity, "sha256": digest}
    memo.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(memo, known)


HEX = frozenset("0123456789abcdef")


def _read_memo(memo: Path | None) -> dict:
    if memo is None:
        return {}
    try:
        known = json.loads(memo.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


MASK_VERSION = "1"   # bump when the way a mask image becomes latent-sized weights changes (builder.latent_mask)


def latent_key(image_digest: str, bucket: tuple[int, int], preprocess_version: str, vae_fingerprint: str,
               arch: str, latent_format: str, conditioning: dict | None = None, mask: str | None = None) -> str:
    """``conditioning`` (edit and i2v models): the cached conditioning fields and the control image's digest,
    which are stored with the latent; ``mask``: the mask image's digest (its weights are stored with it too)."""
    extra = {} if conditioning is None else {"conditioning": conditioning}
    if mask is not None:
        extra["mask"] = {"image": mask, "version": MASK_VERSION}
    return _sha({"kind": "latent", "format": CACHE_FORMAT, "image": image_digest, "bucket": list(bucket),
                 "preprocess": preprocess_version, "vae": vae_fingerprint, "arch": arch,
                 "latent_format": latent_format, **extra})


def text_key(caption: str, te_fingerprints: list[str], arch: str, image: dict | None = None,
             lyrics: str | None = None, options: dict | None = None) -> str:
    """``image``: what of a control image the text encoder reads with the caption (``caption_image``); ``lyrics``:
    an audio model's lyrics, encoded with the caption (an empty string keys like no lyrics: instrumental);
    ``options``: the adapter's ``text_options`` (none: the key of a model without any)."""
    extra = {} if image is None else {"image": image}
    if lyrics:
        extra["lyrics"] = lyrics
    if options:
        extra["options"] = options
    return _sha({"kind": "text", "format": CACHE_FORMAT, "caption": caption, "te": te_fingerprints, "arch": arch,
                 **extra})


def caption_image(adapter, control_digest: str | None, bucket, more_digests=()) -> dict | None:
    """For models whose text encoder reads the control image(s) with the caption: the images' digests and the
    bucket they are cropped to (the embedding depends on both); None for every other model or sample."""
    if not (adapter.caption_sees_control and control_digest):
        return None
    more = {"more_controls": list(more_digests)} if more_digests else {}
    return {"control": control_digest, "bucket": list(bucket[:2]), **more}
