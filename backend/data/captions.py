"""Caption options (diffusion-pipe's meaning): a prefix, shuffled tag variants, caption dropout.

Captions are cached as text embeddings, so every text a run can train on is fixed before training:

- ``caption_prefix`` is prepended to every caption, outside any shuffling.
- ``cache_shuffle_num = N`` (``shuffle_tags = true`` alone means N = 1) splits each caption on
  ``cache_shuffle_delimiter`` and makes N shuffled variants; each variant is its own example (the epoch
  grows N-fold, every variant shares the image's latent), exactly as diffusion-pipe does. Unlike
  diffusion-pipe, variant k of an image is a pure function of (seed, file name, caption, k), so the same
  run config always trains on the same texts and the cache is reused.
- ``uncond_fraction`` (main config) trains a example with the empty caption's embedding; the draw is a pure
  function of (seed, epoch, step, position in the global batch), so it is the same on every rank and in
  a resumed run (see ``train/feed.py``).
"""
from __future__ import annotations

import hashlib
import random

from .items import Example


def shuffled_variant(caption: str, delimiter: str, seed: int, name: str, k: int) -> str:
    tags = caption.split(delimiter)
    digest = hashlib.sha256(f"pipetrain-shuffle:{seed}:{name}:{k}:{caption}".encode()).digest()
    random.Random(int.from_bytes(digest[:8], "little")).shuffle(tags)
    return delimiter.join(tags)


def caption_variants(caption: str, prefix: str, shuffle_num: int, delimiter: str, seed: int, name: str) -> list[str]:
    if shuffle_num == 0:
        return [prefix + caption]
    return [prefix + shuffled_variant(caption, delimiter, seed, name, k) for k in range(shuffle_num)]


def expand_captions(examples: list[Example], seed: int) -> list[Example]:
    """One example per (example, caption, caption variant), each with the exact text it trains on (a file's captions
    from captions.json each make examples, as in diffusion-pipe)."""
    out = []
    for s in examples:
        o = s.item.captions
        for caption in (s.item.caption, *s.item.more_captions):
            for text in caption_variants(caption, o.prefix, o.shuffle_num, o.delimiter, seed, s.item.path.name):
                out.append(Example(item=s.item, bucket=s.bucket, caption=text))
    return out


def drops_caption(seed: int, epoch: int, step: int, position: int, fraction: float) -> bool:
    """Whether the example at ``position`` of this global batch trains with the empty caption."""
    if fraction <= 0:
        return False
    digest = hashlib.sha256(f"pipetrain-uncond:{seed}:{epoch}:{step}:{position}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2 ** 64 < fraction
