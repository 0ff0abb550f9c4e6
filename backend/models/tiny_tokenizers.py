# SPDX-License-Identifier: GPL-3.0-or-later
"""Tokenizers for tiny text-encoder files where ComfyUI ships none to copy: real files carry theirs as a tensor
(``TextEncoderKind.extras``), so tiny files carry these, made deterministically from what ComfyUI does ship."""
from __future__ import annotations

import torch


def tiny_spiece(vocab_size: int, pad_id: int, eos_id: int, unk_id: int, bos_id: int = -1):
    """``extras`` maker for a ``spiece_model`` tensor (a SentencePiece model as uint8, as real files carry it and
    ComfyUI's tokenizer reads it from the file) where the real one is not shipped with ComfyUI: a unigram model
    of ``vocab_size`` pieces with the encoder's own special ids (-1: none),
    trained deterministically on the words of the T5-pile tokenizer that ComfyUI does ship."""
    def spiece() -> torch.Tensor:
        import io

        import sentencepiece

        from ..host.runtime import locate_comfyui
        pile = sentencepiece.SentencePieceProcessor(
            model_file=str(locate_comfyui() / "comfy/text_encoders/t5_pile_tokenizer/tokenizer.model"))
        words = [w for w in (pile.id_to_piece(i).replace("\u2581", "") for i in range(pile.get_piece_size()))
                 if w.isascii() and w.isalpha()]
        out = io.BytesIO()
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(words), model_writer=out, vocab_size=vocab_size, model_type="unigram",
            pad_id=pad_id, eos_id=eos_id, bos_id=bos_id, unk_id=unk_id, num_threads=1, minloglevel=2)
        return torch.frombuffer(bytearray(out.getvalue()), dtype=torch.uint8)
    return spiece


UMT5_TINY_VOCAB = 2000
# UMT5's special ids: pad 0, end 1, unknown 2
UMT5_TINY_SPIECE = tiny_spiece(UMT5_TINY_VOCAB, pad_id=0, eos_id=1, unk_id=2)


GEMMA2_TINY_VOCAB = 2000
# Gemma's special ids: pad 0, end 1, start 2, unknown 3
GEMMA2_TINY_SPIECE = tiny_spiece(GEMMA2_TINY_VOCAB, pad_id=0, eos_id=1, bos_id=2, unk_id=3)


# Mistral's first special tokens, at their real ids (Flux 2's template uses <s>, [INST], [/INST], [SYSTEM_PROMPT],
# [/SYSTEM_PROMPT]; ComfyUI pads with <pad>, id 11), and tekken's pre-tokenizer pattern
MISTRAL_SPECIALS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                    "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]",
                    "[IMG_END]", "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                    "[TOOL_CONTENT]")
TEKKEN_PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
                  r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
MISTRAL_TINY_VOCAB = len(MISTRAL_SPECIALS) + 256


def mistral_tiny_tekken() -> torch.Tensor:
    """The ``tekken_model`` tensor real Mistral files for Flux 2 carry (tekken.json as bytes; ComfyUI's Flux 2
    tokenizer reads it from the file). Mistral's own is not shipped with ComfyUI, so tiny files get a byte-level
    one: Mistral's first 20 special tokens at their real ids, then the 256 bytes."""
    import base64
    import json

    vocab = [{"rank": i, "token_bytes": base64.b64encode(bytes([i])).decode(), "token_str": None} for i in range(256)]
    specials = [{"rank": i, "token_str": name, "is_control": True} for i, name in enumerate(MISTRAL_SPECIALS)]
    tekken = {"config": {"pattern": TEKKEN_PATTERN, "num_vocab_tokens": MISTRAL_TINY_VOCAB,
                         "default_vocab_size": MISTRAL_TINY_VOCAB,
                         "default_num_special_tokens": len(MISTRAL_SPECIALS), "version": "v7"},
              "vocab": vocab, "special_tokens": specials}
    return torch.frombuffer(bytearray(json.dumps(tekken).encode()), dtype=torch.uint8)

