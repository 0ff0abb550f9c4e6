"""Z-Image and Lumina Image 2.0 through ComfyUI's ``comfy.ldm.lumina.model.NextDiT``.

Both are the same network with different configs: Z-Image (6B, Qwen3-4B text, ``z_image_modulation``,
caption and image tokens padded to multiples of 32 with learned pad tokens) and Lumina Image 2.0 (2.6B,
Gemma-2-2B text, grouped-query attention). ComfyUI's ``JointTransformerBlock`` adds its residuals out of
place, so the layers run ComfyUI's own blocks (attention routed to SDPA); what is re-stated is
``NextDiT._forward`` / ``patchify_and_embed`` around them:

    NextInput             t_embedder(1 - t), cap_embedder(text) + pad tokens, x_embedder(patches) + pad
                          tokens, RoPE table                              -> (x, cap, adaln, freqs, keep, size)
    NextContextRefiner xR context_refiner[i](cap)         (text tokens alone, unmodulated)
    NextNoiseRefiner   xR noise_refiner[i](x, adaln)      (image tokens alone)
    NextJoin              cat(cap, x)                                     -> (h, adaln, freqs, keep, size)
    NextBlock          xN layers[i](h, adaln)
    NextOutput            final_layer, unpatchify, crop, negate

ComfyUI feeds the network sigma itself (``ModelSamplingDiscreteFlow`` with multiplier 1.0); the network
embeds ``1 - sigma`` (x ``time_scale``: 1000 for Z-Image, 1 for Lumina 2) and returns minus its own output,
so what ComfyUI sees is the usual velocity: training is rectified flow with target noise - x0 on the
negated output, exactly as ComfyUI samples it. Timesteps are logit-normal without shift unless ``shift`` /
``flux_shift`` are set (ComfyUI samples Z-Image with shift 3, Lumina 2 with 6).

A caption alone is ComfyUI's sequence: its tokens (Z-Image: then learned pad tokens up to a multiple of 32),
numbered 1..L for RoPE, and the image tokens at position L + 1. In a micro-batch the captions are padded to
the longest with tokens masked out as keys, and each sample's image keeps the RoPE position of its own
caption length, so every sample trains as it would alone. LoRA goes on every linear of the main layers and
of both refiners (attention qkv/out, SwiGLU w1/w2/w3, adaLN modulation), which ComfyUI's LoRA loader keys
by their module paths.
"""
from __future__ import annotations

import torch
from torch import nn

from .attention import sdpa_transformer_options, text_key_mask
from .base import ModelAdapter
from .carry import TupleLayer, hide, reveal, sizes, with_grad
from .checkpointing import BlockLayer
from .spec import ArchSpec, comfy_diffusion_model

# Lumina 2's default system prompt in ComfyUI's CLIPTextEncodeLumina2 ("superior"), as the model was trained
LUMINA2_SYSTEM_PROMPT = ("You are an assistant designed to generate superior images with the superior degree of "
                         "image-text alignment based on textual prompts or user prompts.")


def nextdit_config(dim: int, n_layers: int, cap_feat_dim: int, **heads) -> dict:
    """The ``unet_config`` ComfyUI's detection derives from a NextDiT checkpoint (Lumina 2 / Z-Image)."""
    return {"image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": dim, "cap_feat_dim": cap_feat_dim,
            "n_layers": n_layers, "qk_norm": True, **heads}


ZIMAGE_HEADS = {"n_heads": 30, "n_kv_heads": 30, "axes_dims": [32, 48, 48], "axes_lens": [1536, 512, 512],
                "rope_theta": 256.0, "ffn_dim_multiplier": 8.0 / 3.0, "z_image_modulation": True,
                "time_scale": 1000.0, "pad_tokens_multiple": 32}
LUMINA2_HEADS = {"n_heads": 24, "n_kv_heads": 8, "axes_dims": [32, 32, 32], "axes_lens": [300, 512, 512],
                 "rope_theta": 10000.0, "ffn_dim_multiplier": 4.0}

# full: Z-Image (Turbo / base) 6B and Lumina Image 2.0, as ComfyUI detects them. ComfyUI recognises either only
# at its real width (3840 / 2304), so the tiny ones (2 refiner + 2 main layers, heads of 128 / 96 with the real
# RoPE axes) carry their config in the file's metadata. The tiny Z-Image takes the tiny Qwen3's width (64);
# the tiny Lumina 2 keeps Gemma-2-2B's real 2304 and GQA (2 heads, 1 key/value head).
NEXTDIT_CONFIGS = {
    "z_image": {"full": nextdit_config(3840, 30, 2560, **ZIMAGE_HEADS),
                "tiny": nextdit_config(256, 2, 64, **{**ZIMAGE_HEADS, "n_heads": 2, "n_kv_heads": 2})},
    "lumina2": {"full": nextdit_config(2304, 26, 2304, **LUMINA2_HEADS),
                "tiny": nextdit_config(192, 2, 2304, **{**LUMINA2_HEADS, "n_heads": 2, "n_kv_heads": 1})},
}


def _config(arch: str):
    return lambda size: dict(NEXTDIT_CONFIGS[arch]["full" if size == "full" else "tiny"])


build_nextdit = comfy_diffusion_model("comfy.ldm.lumina.model:NextDiT")


ZIMAGE_SPEC = ArchSpec(
    title="Z-Image", comfy_configs=("ZImage",), unet_config=_config("z_image"), build=build_nextdit,
    detected_sizes=("full",), text_encoders=("qwen3_4b",), clip_type="LUMINA2",
    vae="kl16", example_file="z_image_turbo_bf16.safetensors")
LUMINA2_SPEC = ArchSpec(
    title="Lumina Image 2.0", comfy_configs=("Lumina2",), unet_config=_config("lumina2"), build=build_nextdit,
    detected_sizes=("full",), text_encoders=("gemma2_2b",), clip_type="LUMINA2",
    vae="kl16", example_file="lumina_2_model_bf16.safetensors")


def caption_keep(lengths: torch.Tensor, multiple: int | None) -> torch.Tensor:
    """Each caption's sequence length as ComfyUI runs it alone: its tokens, padded up to ``multiple``."""
    if not multiple:
        return lengths
    return (lengths + multiple - 1) // multiple * multiple


class NextInput(TupleLayer):
    cost = 0.05

    def __init__(self, dm, objective, dtype):
        super().__init__()
        # only the embedders (and pad tokens) become children: the blocks belong to other layers
        self.x_embedder, self.t_embedder, self.cap_embedder = dm.x_embedder, dm.t_embedder, dm.cap_embedder
        self.rope_embedder = dm.rope_embedder
        self.multiple = dm.pad_tokens_multiple
        if self.multiple is not None:
            self.x_pad_token, self.cap_pad_token = dm.x_pad_token, dm.cap_pad_token
        self.patch_size, self.time_scale = dm.patch_size, dm.time_scale
        self.objective, self.dtype = objective, dtype

    def _pad_to_multiple(self, tokens: torch.Tensor, pad_token: torch.Tensor) -> torch.Tensor:
        extra = (-tokens.shape[1]) % self.multiple if self.multiple else 0
        if not extra:
            return tokens
        pad = pad_token.to(tokens).unsqueeze(0).expand(tokens.shape[0], extra, -1)
        return torch.cat((tokens, pad), dim=1)

    def run(self, latents, noise, t, context, lengths):
        import comfy.ldm.common_dit

        x_t = self.objective.noisy(latents, noise, t).to(self.dtype)
        b, c, h, w = x_t.shape
        p = self.patch_size
        x = comfy.ldm.common_dit.pad_to_patch_size(x_t, (p, p))
        big_h, big_w = x.shape[-2:]
        timestep = self.objective.model_timestep(t).float()   # ComfyUI: model_sampling.timestep(sigma).float()
        adaln = self.t_embedder((1.0 - timestep) * self.time_scale, dtype=x.dtype)

        # the caption: its own tokens, then (Z-Image) pad tokens up to its multiple, then masked batch padding
        keep = caption_keep(lengths, self.multiple)
        cap_len = int(keep.max())
        cap = self.cap_embedder(context.to(self.dtype))
        cap = torch.nn.functional.pad(cap, (0, 0, 0, cap_len - cap.shape[1]))[:, :cap_len]
        if self.multiple:
            own = torch.arange(cap_len, device=cap.device)[None, :, None] < lengths.to(cap.device)[:, None, None]
            cap = torch.where(own, cap, self.cap_pad_token.to(cap))

        patches = x.view(b, c, big_h // p, p, big_w // p, p).permute(0, 2, 4, 3, 5, 1).flatten(3).flatten(1, 2)
        x = self.x_embedder(patches)
        image_tokens = x.shape[1]
        x = self._pad_to_multiple(x, self.x_pad_token if self.multiple else None)

        # RoPE ids: caption 1..L; image (L_own + 1, row, column); image pad tokens 0
        ids = torch.zeros(b, cap_len + x.shape[1], 3, dtype=torch.float32, device=x.device)
        ids[:, :cap_len, 0] = torch.arange(cap_len, dtype=torch.float32, device=x.device) + 1.0
        rows = torch.arange(big_h // p, dtype=torch.float32, device=x.device)
        cols = torch.arange(big_w // p, dtype=torch.float32, device=x.device)
        image = slice(cap_len, cap_len + image_tokens)
        ids[:, image, 0] = keep.to(x.device, torch.float32)[:, None] + 1.0
        ids[:, image, 1] = rows.view(-1, 1).repeat(1, big_w // p).flatten()
        ids[:, image, 2] = cols.view(1, -1).repeat(big_h // p, 1).flatten()
        freqs = self.rope_embedder(ids).movedim(1, 2)

        size = sizes(cap_len, big_h, big_w, h, w)
        return with_grad(x), with_grad(cap), hide(adaln), hide(freqs.float()), keep, size


class NextContextRefiner(BlockLayer):
    cost = 0.1

    def block_forward(self, cap, freqs, keep):
        mask = text_key_mask(keep, cap.shape[1], 0)
        return self.block(cap, mask, reveal(freqs, torch.float32)[:, :cap.shape[1]],
                          transformer_options=sdpa_transformer_options())

    def run(self, x, cap, adaln, freqs, keep, size):
        return x, self.checkpointed(cap, freqs, keep), adaln, freqs, keep, size


class NextNoiseRefiner(BlockLayer):
    cost = 0.9

    def block_forward(self, x, adaln, freqs, size):
        return self.block(x, None, reveal(freqs, torch.float32)[:, int(size[0]):], reveal(adaln, self.dtype),
                          transformer_options=sdpa_transformer_options())

    def run(self, x, cap, adaln, freqs, keep, size):
        return self.checkpointed(x, adaln, freqs, size), cap, adaln, freqs, keep, size


class NextJoin(TupleLayer):
    cost = 0.0

    def run(self, x, cap, adaln, freqs, keep, size):
        return torch.cat((cap, x), dim=1), adaln, freqs, keep, size


class NextBlock(BlockLayer):
    cost = 1.0

    def block_forward(self, h, adaln, freqs, keep, size):
        cap_len = int(size[0])
        mask = text_key_mask(keep, cap_len, h.shape[1] - cap_len)
        return self.block(h, mask, reveal(freqs, torch.float32), reveal(adaln, self.dtype),
                          transformer_options=sdpa_transformer_options())

    def run(self, h, adaln, freqs, keep, size):
        return self.checkpointed(h, adaln, freqs, keep, size), adaln, freqs, keep, size


class NextOutput(TupleLayer):
    cost = 0.05

    def __init__(self, dm, dtype):
        super().__init__()
        self.final_layer, self.dtype = dm.final_layer, dtype
        self._unpatchify = dm.unpatchify

    def run(self, h, adaln, freqs, keep, size):
        cap_len, big_h, big_w, height, width = (int(v) for v in size)
        out = self.final_layer(h, reveal(adaln, self.dtype))
        out = self._unpatchify(out, [(big_h, big_w)] * h.shape[0], [cap_len] * h.shape[0], return_tensor=True)
        out = -out[:, :, :height, :width]
        return out.to(torch.promote_types(out.dtype, torch.float32))


class NextDiTAdapter(ModelAdapter):
    """Shared by Z-Image and Lumina 2; the subclasses name the files and the caption format."""
    latent_format = "Flux"
    lora_block_prefixes = ("layers", "noise_refiner", "context_refiner")
    text_fields = ("cond",)
    text_lengths = True        # the layers mask the zero padding of the captions

    def caption_text(self, caption: str) -> str:
        return caption

    def encode_caption(self, clip, caption):
        tokens = clip.tokenize(self.caption_text(caption))
        out = clip.encode_from_tokens(tokens, return_dict=True)
        return {"cond": out["cond"][0].float().cpu()}

    def objective(self):
        return self.flow_matching()

    def to_layers(self):
        dm = self.diffusion_model
        layers: list[nn.Module] = [NextInput(dm, self.objective(), self.dtype)]
        layers += [NextContextRefiner(b, self.dtype) for b in dm.context_refiner]
        layers += [NextNoiseRefiner(b, self.dtype) for b in dm.noise_refiner]
        layers.append(NextJoin())
        layers += [NextBlock(b, self.dtype) for b in dm.layers]
        layers.append(NextOutput(dm, self.dtype))
        return layers

    def sample_conditioning(self, text, guidance):
        return [[text["cond"][None], {}]]

    def probe_text(self, generator):
        tokens = 12
        width = self.diffusion_model.cap_embedder[1].in_features
        return [torch.randn(1, tokens, width, generator=generator), torch.tensor([tokens])]

    def reference_forward(self, x_t, t, text):
        """ComfyUI's NextDiT forward, one sample at a time with its unpadded caption (as ComfyUI runs
        conditionings of different lengths), fed as ``BaseModel._apply_model`` feeds it."""
        cond, lengths = text
        dm, timestep = self.diffusion_model, self.objective().model_timestep(t).float()
        outs = []
        for i in range(x_t.shape[0]):
            n = int(lengths[i])
            outs.append(dm(x_t[i:i + 1].to(self.dtype), timestep[i:i + 1], cond[i:i + 1, :n].to(self.dtype), n))
        return torch.cat(outs)


class ZImageAdapter(NextDiTAdapter):
    arch = "z_image"
    spec = ZIMAGE_SPEC


class Lumina2Adapter(NextDiTAdapter):
    arch = "lumina2"
    dp_aliases = ("lumina_2",)
    dp_lumina_shift = True
    spec = LUMINA2_SPEC

    def caption_text(self, caption):
        """Captions as ComfyUI's CLIPTextEncodeLumina2 encodes a prompt (its default system prompt)."""
        return f"{LUMINA2_SYSTEM_PROMPT} <Prompt Start> {caption}"
