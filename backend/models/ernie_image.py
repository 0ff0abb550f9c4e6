# SPDX-License-Identifier: GPL-3.0-or-later
"""Ernie-Image (issue #37) through ComfyUI's ``comfy.ldm.ernie.model.ErnieImageModel`` (from ComfyUI 0.19.0).

One stream of shared-adaLN blocks (36 of width 4096, 32 heads of 128, a gated-GELU MLP 12288 wide) over the image
tokens followed by the text tokens, attending to all of them; one modulation table (6 chunks) for every block,
made once from the timestep (t x 1000, as ComfyUI's ``ModelSamplingFlux`` with multiplier 1000 feeds it); a 3-axis
split-half RoPE in which the text numbers its tokens on the first axis and the image sits after the text on that
axis. Latents are Flux 2's (128 channels, one token per latent pixel). The text is Ministral-3-3B's second-last
hidden states (no template, no padding; ComfyUI's ``ErnieTEModel``).

ComfyUI runs one caption at a time, unmasked, with the image placed at the caption's own length on RoPE's first
axis. A batch pads its captions to the longest, so the layers place each sample's image at its own caption length
and mask the padding as keys: every sample trains as ComfyUI computes it alone. The blocks' residuals are out of
place already; the layers re-state them only to run torch SDPA with that mask (ComfyUI's attention call takes no
override) and ComfyUI's split-half RoPE. LoRA goes on every linear of the blocks (attention q / k / v / out, the
MLP's three); the shared modulation, the embedders and the final layer stay frozen, as in diffusion-pipe
(``ErnieImageSharedAdaLNBlock``). Rectified flow with ComfyUI's shift 3 unless ``[model] shift`` is set
(diffusion-pipe: none; check-config says so).

ComfyUI's detection reads only that a file is Ernie-Image (``layers.0.mlp.linear_fc2``) and builds the published
size; a tiny file carries its narrower config in its metadata.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .attention import text_key_mask
from .base import ModelAdapter
from .carry import TupleLayer, hide, reveal, sizes, with_grad
from .checkpointing import CheckpointedLayer
from .encoders import TextEncoderKind, comfy_llm_config
from .objectives import FlowMatching
from .spec import ArchSpec, comfy_diffusion_model, comfy_text_model
from .tiny_tokenizers import MISTRAL_TINY_VOCAB

DEFAULT_SHIFT = 3.0          # ComfyUI's ErnieImage sampling_settings
MULTIPLIER = 1000.0          # ... and its network timestep multiplier
MIN_COMFYUI = "0.19.0"       # the first ComfyUI release with comfy.supported_models.ErnieImage
TINY_TEXT_WIDTH = 64         # the tiny Ministral-3-3B's width


def ernie_config(size: str) -> dict:
    """full: Ernie-Image as ComfyUI's detection gives it (the class's defaults); tiny: 2 blocks at width 128 (2 heads
    of 64) reading the tiny Ministral's 64-wide text."""
    if size == "full":
        return {"image_model": "ernie"}
    return {"image_model": "ernie", "hidden_size": 128, "num_attention_heads": 2, "num_layers": 2,
            "ffn_hidden_size": 256, "text_in_dim": TINY_TEXT_WIDTH, "rope_axes_dim": [16, 24, 24]}


# Ministral-3-3B (Ernie-Image's text encoder; ComfyUI reads its second-last hidden states): the tiny one keeps 3
# layers at width 64 with the byte-level tekken tokenizer of the tiny Mistral (``encoders.py``)
MINISTRAL3_3B = TextEncoderKind("Ministral-3-3B", comfy_llm_config("Ministral3_3BConfig"),
                                {"vocab_size": MISTRAL_TINY_VOCAB, "hidden_size": TINY_TEXT_WIDTH,
                                 "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 1,
                                 "num_key_value_heads": 1},
                                comfy_text_model("comfy.text_encoders.llama:Ministral3_3B"), "MINISTRAL_3_3B")


def _ministral_kind() -> TextEncoderKind:
    """The kind with the tekken tokenizer and the transformers-5 patch the Flux 2 Mistral kind carries (one
    tokenizer family)."""
    import dataclasses

    from .encoders import TEXT_ENCODERS
    mistral = TEXT_ENCODERS["mistral3_24b"]
    return dataclasses.replace(MINISTRAL3_3B, extras=mistral.extras, comfy_patch=mistral.comfy_patch)


ERNIE_IMAGE_SPEC = ArchSpec(
    title="Ernie-Image", comfy_configs=("ErnieImage",), unet_config=ernie_config,
    build=comfy_diffusion_model("comfy.ldm.ernie.model:ErnieImageModel"), detected_sizes=("full",),
    # ComfyUI's Ministral-3-3B file gives Ernie's encoder whatever CLIPLoader type is chosen; diffusion-pipe's
    # config names the type 'flux2'
    text_encoders=("ministral3_3b",), clip_type="STABLE_DIFFUSION", text_encoder_types=("flux2", "ernie"),
    vae="flux2", example_file="ernie-image.safetensors", min_comfyui=MIN_COMFYUI,
    text_encoder_kinds={"ministral3_3b": _ministral_kind()})


def _positions(lengths: torch.Tensor, text_len: int, hp: int, wp: int, device) -> torch.Tensor:
    """RoPE positions [B, hp*wp + text_len, 3] as ComfyUI gives a sample alone: the image at its caption's length on
    the first axis (rows, columns on the others), the text numbered on the first axis."""
    b = lengths.shape[0]
    image = torch.zeros(b, hp, wp, 3, device=device, dtype=torch.float32)
    image[..., 0] = lengths.to(device=device, dtype=torch.float32)[:, None, None]
    image[..., 1] = torch.linspace(0, hp - 1, steps=hp, device=device, dtype=torch.float32)[:, None]
    image[..., 2] = torch.linspace(0, wp - 1, steps=wp, device=device, dtype=torch.float32)[None, :]
    text = torch.zeros(b, text_len, 3, device=device, dtype=torch.float32)
    text[..., 0] = torch.linspace(0, text_len - 1, steps=text_len, device=device, dtype=torch.float32)
    return torch.cat((image.view(b, hp * wp, 3), text), dim=1)


def _attention(attn, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``ErnieImageAttention`` (its training path: q / k norms, then ComfyUI's split-half RoPE) through torch SDPA
    with the key mask."""
    import comfy.quant_ops

    b, s, _ = x.shape
    q = attn.norm_q(attn.to_q(x).view(b, s, attn.heads, attn.head_dim))
    k = attn.norm_k(attn.to_k(x).view(b, s, attn.heads, attn.head_dim))
    q, k = comfy.quant_ops.ck.apply_rope_split_half(q, k, rope)
    v = attn.to_v(x).view(b, s, attn.heads, attn.head_dim)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return attn.to_out[0](out.transpose(1, 2).reshape(b, s, attn.heads * attn.head_dim))


def ernie_block(block, x, rope, table, mask):
    """``ErnieImageSharedAdaLNBlock.forward`` with the attention above; ``table`` the shared modulation [B, 6 x W]."""
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = table[:, None].chunk(6, dim=-1)
    h = block.adaLN_sa_ln(x) * (1 + scale_msa) + shift_msa
    x = x + gate_msa * _attention(block.self_attention, h, rope, mask)
    h = block.adaLN_mlp_ln(x) * (1 + scale_mlp) + shift_mlp
    return x + gate_mlp * block.mlp(h)


class ErnieInput(TupleLayer):
    cost = 0.05

    def __init__(self, dm, objective, dtype):
        super().__init__()
        # only the input modules become children: the blocks and the final layer belong to other layers
        self.x_embedder, self.text_proj, self.pos_embed = dm.x_embedder, dm.text_proj, dm.pos_embed
        self.time_proj, self.time_embedding, self.adaLN_modulation = dm.time_proj, dm.time_embedding, dm.adaLN_modulation
        self.patch_size, self.objective, self.dtype = dm.patch_size, objective, dtype

    def run(self, latents, noise, t, text, lengths):
        x = self.objective.noisy(latents, noise, t).to(self.dtype)
        hp, wp = x.shape[-2] // self.patch_size, x.shape[-1] // self.patch_size
        txt = text.to(self.dtype)
        if self.text_proj is not None:
            txt = self.text_proj(txt)
        rope = self.pos_embed(_positions(lengths, txt.shape[1], hp, wp, x.device))
        vec = self.time_embedding(self.time_proj(self.objective.model_timestep(t)).to(self.dtype))
        table = self.adaLN_modulation(vec)
        hw = sizes(x.shape[-2], x.shape[-1], hp, wp)
        return with_grad(torch.cat((self.x_embedder(x), txt), dim=1)), hide(table), hide(vec), hide(rope), lengths, hw


class ErnieBlock(CheckpointedLayer):
    cost = 1.0

    def __init__(self, block, dtype):
        super().__init__()
        self.block, self.dtype = block, dtype

    def block_forward(self, x, table, vec, rope, lengths, hw):
        image = int(hw[2]) * int(hw[3])
        mask = text_key_mask(lengths, x.shape[1] - image, image, text_first=False)
        x = ernie_block(self.block, x, reveal(rope, torch.float32), reveal(table, self.dtype), mask)
        return x, table, vec, rope, lengths, hw


class ErnieOutput(TupleLayer):
    cost = 0.05

    def __init__(self, dm, dtype):
        super().__init__()
        self.final_norm, self.final_linear, self.dtype = dm.final_norm, dm.final_linear, dtype
        self.patch_size, self.out_channels = dm.patch_size, dm.out_channels

    def run(self, x, table, vec, rope, lengths, hw):
        h, w, hp, wp = (int(v) for v in hw)
        p = self.patch_size
        x = self.final_norm(x, reveal(vec, self.dtype)).type_as(x)
        patches = self.final_linear(x)[:, :hp * wp]
        out = (patches.view(x.shape[0], hp, wp, p, p, self.out_channels).permute(0, 5, 1, 3, 2, 4)
               .reshape(x.shape[0], self.out_channels, h, w))
        return out.to(torch.promote_types(out.dtype, torch.float32))


class ErnieImageAdapter(ModelAdapter):
    arch = "ernie_image"
    spec = ERNIE_IMAGE_SPEC
    latent_format = "Flux2"
    lora_block_prefixes = ("layers",)
    text_fields = ("ministral",)
    text_lengths = True

    def encode_caption(self, clip, caption):
        """Ministral-3-3B's second-last hidden states of the caption, as ComfyUI's Ernie encoder gives them."""
        out = clip.encode_from_tokens(clip.tokenize(caption), return_dict=True)
        return {self.text_fields[0]: out["cond"][0].float().cpu()}

    def objective(self):
        return self.flow_matching(default_shift=DEFAULT_SHIFT, default_multiplier=MULTIPLIER)

    def to_layers(self):
        dm = self.diffusion_model
        layers: list[nn.Module] = [ErnieInput(dm, self.objective(), self.dtype)]
        layers += [ErnieBlock(b, self.dtype) for b in dm.layers]
        layers.append(ErnieOutput(dm, self.dtype))
        return layers

    def sample_conditioning(self, text, guidance):
        return [[text[self.text_fields[0]][None], {}]]

    def empty_latent(self, width, height, frames=1):
        return torch.zeros(1, 128, height // 16, width // 16)

    def probe_text(self, generator):
        dm = self.diffusion_model
        width = dm.text_proj.in_features if dm.text_proj is not None else dm.hidden_size
        return self.collate_text([{self.text_fields[0]: torch.randn(12, width, generator=generator)}])

    def reference_forward(self, x_t, t, text):
        context, lengths = text   # one sample, its own length
        return self.diffusion_model(x_t.to(self.dtype), self.objective().model_timestep(t),
                                    context[:, :int(lengths[0])].to(self.dtype))
