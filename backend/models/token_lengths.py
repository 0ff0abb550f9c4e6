# SPDX-License-Identifier: GPL-3.0-or-later
"""diffusion-pipe's fixed token lengths (its Hugging Face tokenizers' ``padding = "max_length"``, ``truncation``) on
ComfyUI's token lists: a caption's tokens cut to ``length`` and padded to it.

ComfyUI's tokenizers for these encoders pad to a minimum and cut nothing (AuraFlow's Pile-T5 to 256 tokens, HiDream's
Llama 3 to 128); its encoders then read the pad tokens as padding (zeroed, or behind the text). A token list here is
one batch of ComfyUI's ``tokenize`` output: ``(token, weight)`` pairs, the text first, its pads after."""
from __future__ import annotations


def fit_tokens(batch: list, length: int, pad: int, keep_last: bool) -> list:
    """``batch`` cut to ``length`` tokens before its pads (``keep_last``: its last token before them, T5's end
    token, stays at the end, as a tokenizer's truncation keeps it) and padded with ``pad`` to ``length``."""
    text = []
    for entry in batch:
        if entry[0] == pad:
            break
        text.append(entry)
    if len(text) > length:
        text = text[:length - 1] + text[-1:] if keep_last else text[:length]
    filler = (pad, 1.0, *batch[0][2:])   # the pad of ComfyUI's own lists, word id included where they carry one
    return text + [filler] * (length - len(text))
