"""Fill the cache: every missing latent and text embedding is encoded once, the work split over ranks."""
from __future__ import annotations

import gc
import hashlib
import logging
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..errors import DatasetError
from .manifest import CacheEntry
from .store import CacheStore

log = logging.getLogger(__name__)
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class TextWork:
    """One caption to encode; models whose text encoder reads the control image also get that image, cropped
    to the sample's bucket as its latent is."""
    caption: str
    control: str = ""
    bucket: tuple = ()
    # keyword-only: callers name them, so a field added later cannot take another's place
    lyrics: str = field(default="", kw_only=True)   # audio models: encoded with the caption (tags + lyrics)
    more_controls: tuple[str, ...] = field(default=(), kw_only=True)   # edit models: the further control images


def missing_work(entries: list[CacheEntry], store: CacheStore) -> tuple[dict, dict]:
    latents, texts = {}, {}
    stored_latents, stored_texts = store.keys("latents"), store.keys("text")
    for e in entries:
        if e.latent not in latents and e.latent not in stored_latents:
            latents[e.latent] = e
        if e.text not in texts and e.text not in stored_texts:
            texts[e.text] = entry_text_work(e)
    return latents, texts


def entry_text_work(e: CacheEntry) -> TextWork:
    return TextWork(e.caption, e.control, e.bucket, lyrics=e.lyrics, more_controls=e.more_controls)


def _mine(keys, rank: int, world: int) -> list[str]:
    return [k for i, k in enumerate(sorted(keys)) if i % world == rank]


def _load_media(work: dict[str, CacheEntry], chunk: list[str], bucket: tuple, framerate, audio: bool = False):
    """One chunk's pixels [B, H, W, 3] (images), list of clips [F, H, W, 3] (videos, bucket (w, h, frames)) or list of
    (waveform [channels, samples], sample rate) (audio, bucket (seconds, 1))."""
    from ..data import load_pixels
    from ..data.video import load_video

    if audio:
        from ..data.audio import load_clip
        return [load_clip(Path(work[k].path), bucket[0]) for k in chunk]
    if len(bucket) == 3:
        return [load_video(Path(work[k].path), bucket, framerate) for k in chunk]
    return torch.stack([load_pixels(Path(work[k].path), bucket, _read_as_keyed(work[k])) for k in chunk])


def _read_as_keyed(entry: CacheEntry) -> bytes:
    """A picture's bytes, read once: the ones its cache key was made from, or ``DatasetError`` naming the file
    where it changed since (its latent would be stored under the old picture's key)."""
    data = Path(entry.path).read_bytes()
    if entry.digest and hashlib.sha256(data).hexdigest() != entry.digest:
        raise DatasetError(f"{entry.path} changed while the cache was being built: start the run again (its "
                           "cache key is then made from the picture as it is now)")
    return data


def encode_latents(adapter, store: CacheStore, work: dict[str, CacheEntry], batch_size: int,
                   progress: Progress) -> None:
    by_bucket = defaultdict(list)
    for key, e in work.items():
        by_bucket[e.bucket].append(key)
    chunks = [(bucket, keys[i:i + batch_size]) for bucket, keys in sorted(by_bucket.items())
              for i in range(0, len(keys), batch_size)]
    vae = adapter.load_vae()
    audio = getattr(adapter, "audio", False)
    done, total = 0, len(work)
    # the next chunk's files are decoded in a thread while the encoder works on this one (decoding releases the
    # GIL): otherwise the device waits for every picture's decode
    with ThreadPoolExecutor(1) as loader:
        def load(n):
            return loader.submit(_load_media, work, chunks[n][1], chunks[n][0], adapter.framerate, audio)
        pending = load(0) if chunks else None
        for n, (bucket, chunk) in enumerate(chunks):
            media = pending.result()
            if n + 1 < len(chunks):
                pending = load(n + 1)
            with torch.no_grad():
                if audio:             # audio clips (waveform, rate), one at a time
                    latents = [adapter.encode_audio(vae, waveform, rate) for waveform, rate in media]
                elif len(bucket) == 3:  # video clips (width, height, frames), one at a time
                    latents = [adapter.encode_video(vae, frames) for frames in media]
                else:
                    pixels = media
                    latents = adapter.encode_images(vae, pixels)
                    media = [pixels[j:j + 1] for j in range(len(chunk))]
                payloads = [{"latent": lat} for lat in latents]
                for k, payload in zip(chunk, payloads):
                    if work[k].mask:
                        payload["mask"] = latent_mask(Path(work[k].mask), bucket, payload["latent"])
                if adapter.conditioning_fields:
                    for k, m, payload in zip(chunk, media, payloads):
                        payload.update(_conditioning(adapter, vae, work[k], m, bucket))
            for k, payload in zip(chunk, payloads):
                store.put("latents", k, payload)
            done += len(chunk)
            progress("latents", done, total)
    del vae
    _free()


def latent_mask(path: Path, bucket, latent: torch.Tensor) -> torch.Tensor:
    """The mask image's red channel (white 1: trains fully, black 0: not at all), cropped and resized as the image
    was, then averaged down to the latent's grid: [1, H, W] for an image latent [C, H, W], [1, 1, H, W] for a clip
    (the same weights on every frame)."""
    from torch.nn import functional as F

    from ..data import load_pixels

    red = load_pixels(path, bucket[:2])[..., 0][None, None]
    weights = F.interpolate(red, size=tuple(latent.shape[-2:]), mode="area")[0]
    return weights.reshape((1,) * (latent.ndim - 2) + tuple(latent.shape[-2:])).to(torch.float32)


def control_pixels(control: str, more: tuple[str, ...], bucket) -> torch.Tensor | None:
    """A sample's control images at its bucket, [N, H, W, 3] in control_path's order, or None without any."""
    from ..data import load_pixels

    if not control:
        return None
    return torch.stack([load_pixels(Path(p), bucket[:2]) for p in (control, *more)])


def control_inputs(adapter, bucket, control: str, more: tuple[str, ...] = (), control_mask: str | None = None,
                   reference: str | None = None) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """A sample's control pixels at ``bucket`` as ``encode_conditioning`` takes them: the control (a control-video
    model's clip: its control video, ``_control_video``), and wan_vace's control mask (read as the control is) and
    reference image, keyed only where given. Epoch samples of control-video models read theirs here too."""
    if control and len(bucket) == 3 and adapter.video_control:
        pixels = _control_video(Path(control), bucket, adapter.framerate)
    else:
        pixels = control_pixels(control, more, bucket)
    vace = {}
    if control_mask:
        vace["control_mask"] = (_control_video(Path(control_mask), bucket, adapter.framerate)
                                if len(bucket) == 3 else control_pixels(control_mask, (), bucket))
    if reference:
        vace["reference"] = control_pixels(reference, (), bucket)
    return pixels, vace


def _conditioning(adapter, vae, entry: CacheEntry, media: torch.Tensor, bucket) -> dict[str, torch.Tensor]:
    control, vace = control_inputs(adapter, bucket, entry.control, entry.more_controls, entry.control_mask,
                                   entry.reference)
    out = adapter.encode_conditioning(vae, media, control, **vace)
    if set(out) != set(adapter.conditioning_fields):
        raise RuntimeError(f"{type(adapter).__name__}.encode_conditioning returned {sorted(out)}, "
                           f"expected {list(adapter.conditioning_fields)}")
    return out


def _control_video(path: Path, bucket, framerate) -> torch.Tensor:
    """A clip's control, its frames taken as the clip's are (resampled, cropped to the bucket) up to the bucket's
    length; a shorter control video gives its own frames only, a control image one frame (ComfyUI's control
    nodes fill the frames a control lacks with their own default)."""
    from ..data import load_pixels
    from ..data.video import frames_at_rate, load_video, probe_video

    info = probe_video(path)
    if info is None:
        return load_pixels(path, bucket[:2])[None]
    count = min(bucket[2], frames_at_rate(info.frames, info.fps, framerate))
    return load_video(path, (*bucket[:2], count), framerate)


def encode_text(adapter, clip, work: TextWork) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        if adapter.caption_sees_control and work.control:
            image = control_pixels(work.control, work.more_controls, work.bucket)
            return adapter.encode_caption_with_image(clip, work.caption, image)
        if getattr(adapter, "audio", False):
            return adapter.encode_song(clip, work.caption, work.lyrics)
        return adapter.encode_caption(clip, work.caption)


def encode_texts(adapter, store: CacheStore, work: dict[str, TextWork], progress: Progress) -> None:
    clip = adapter.load_text_encoders()
    for i, key in enumerate(sorted(work)):
        store.put("text", key, encode_text(adapter, clip, work[key]))
        progress("text", i + 1, len(work))
    del clip
    _free()


def fill(adapter, store: CacheStore, entries: list[CacheEntry], rank: int, world: int, batch_size: int,
         progress: Progress, extra_texts: dict[str, TextWork] | None = None) -> tuple[int, int]:
    """Encode this rank's share of what is missing (``extra_texts``: {key: work} needed besides the
    entries', e.g. the empty caption for caption dropout); returns (latents, texts) encoded here."""
    latents, texts = missing_work(entries, store)
    texts.update({k: c for k, c in (extra_texts or {}).items() if not store.has("text", k)})
    my_latents = {k: latents[k] for k in _mine(latents, rank, world)}
    my_texts = {k: texts[k] for k in _mine(texts, rank, world)}
    if my_latents:
        encode_latents(adapter, store, my_latents, batch_size, progress)
    if my_texts:
        encode_texts(adapter, store, my_texts, progress)
    return len(my_latents), len(my_texts)


def _free() -> None:
    gc.collect()
    try:
        import comfy.model_management as mm
        mm.unload_all_models()
        mm.soft_empty_cache()
    except Exception:  # noqa: BLE001  (freeing memory is best effort)
        pass
