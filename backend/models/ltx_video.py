"""LTX-Video (2B / 13B, text-to-video) through ComfyUI's ``comfy.ldm.lightricks.model.LTXVModel``.

Latents are 5-D [B, 128, T, H, W] from LTX's causal video VAE (``comfy.ldm.lightricks.vae``: 32x spatial,
8x temporal with a causal first frame, so a clip of 8k + 1 frames gives k + 1 latent frames); a still image
is a one-frame clip. Each latent pixel is one token (patch size 1). Clips are resampled to 25 fps, the frame
rate ComfyUI's LTXV conditioning assumes, which also scales the time axis of the RoPE coordinates.

ComfyUI's ``BasicTransformerBlock`` adds its residuals in place (``x.addcmul_``, ``x +=``), so each block's
maths is re-stated out of place around ComfyUI's own submodules (``attn1``, ``attn2``, ``ff``,
``scale_shift_table``; attention routed to SDPA):

    LTXInput        patchify, patchify_proj, RoPE from the pixel coordinates, adaln_single(1000 t),
                    caption_projection                    -> (x, context, timestep, embedded_t, pe, size, lengths)
    LTXBlock  xN    x + gate_msa attn1(mod(x)); x + attn2(x, context); x + gate_mlp ff(mod(x))
    LTXOutput       norm_out with scale_shift_table, proj_out, unpatchify

Everything but x comes from frozen weights or the data and travels bit-cast to integers.

Training is rectified flow (target noise - x0). The network takes t itself (ComfyUI's ``ModelSamplingFlux``
timestep; the model multiplies by 1000). Timesteps are drawn logit-normal and shifted with LTX's
resolution-dependent shift -- ComfyUI's ``ModelSamplingLTXV`` / ``LTXVScheduler``: mu linear in the latent's
token count T x H x W (0.95 at 1024 tokens, 2.05 at 4096), t -> e^mu t / (1 + (e^mu - 1) t), the same shift
Lightricks' trainer applies to its logit-normal timesteps. A ``shift`` in [model] replaces it with that
constant shift. The text is T5-XXL's, as ComfyUI's LTXV text encoder gives it, cut to the caption's own
tokens (ComfyUI pads to 128 tokens and masks the padding out of cross-attention, which is the same);
captions of different lengths in one micro-batch are masked. LoRA goes on every linear of the blocks
(self- and cross-attention q/k/v/out, feed-forward).

``ltx_video_i2v`` trains the image-to-video mode ComfyUI samples with ``LTXVImgToVideo``: the first latent frame
is the clean latent of the clip's first frame (cached as ``first_frame``, encoded alone as the node encodes its
image), the node's noise mask gives its tokens timestep 0 and the others t (``LTXV.process_timestep``: one
timestep per token), and the loss covers the other frames (the sampler keeps the given frame). Clips only.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .attention import sdpa_transformer_options
from .base import GivenFirstFrame, ModelAdapter, VideoLatents
from .carry import TupleLayer, hide, reveal, with_grad
from .checkpointing import BlockLayer
from .objectives import FlowMatching
from .spec import ArchSpec, comfy_diffusion_model

LTX_FPS = 25                      # ComfyUI's LTXV default frame_rate (LTXVConditioning, model_base.LTXV)
LTX_SHIFT_TOKENS = (1024, 4096)   # ModelSamplingLTXV / LTXVScheduler: mu interpolated between these token counts
LTX_SHIFT_MU = (0.95, 2.05)       # ... from base_shift to max_shift


def ltx_config(num_layers: int, attention_head_dim: int) -> dict:
    """The ``unet_config`` ComfyUI's detection derives from LTX-Video weights (32 heads; the caption projection
    maps to the inner width, which is also the cross-attention width)."""
    return {"image_model": "ltxv", "num_layers": num_layers, "attention_head_dim": attention_head_dim,
            "cross_attention_dim": 32 * attention_head_dim}


# full: LTX-Video 2B (0.9.x), what ComfyUI detects from the weights alone. The 13B (48 layers, heads of 128)
# takes further settings (e.g. causal_temporal_positioning) from its file's "config" metadata.
# tiny: 2 blocks at width 256 (32 heads of 8), which ComfyUI still detects.
LTX_CONFIGS = {"full": ltx_config(28, 64), "tiny": ltx_config(2, 8)}


def ltxv_unet_config(size: str) -> dict:
    return dict(LTX_CONFIGS["full" if size == "full" else "tiny"])


LTXV_SPEC = ArchSpec(
    title="LTX-Video", comfy_configs=("LTXV",), unet_config=ltxv_unet_config,
    build=comfy_diffusion_model("comfy.ldm.lightricks.model:LTXVModel"),
    detected_sizes=("tiny", "full"), text_encoders=("t5xxl",), clip_type="LTXV",
    vae="ltxv", example_file="ltx-video-2b-v0.9.5.safetensors")


def ltx_mu(tokens: int) -> float:
    """LTX's shift for a latent of ``tokens`` tokens (ComfyUI's ModelSamplingLTXV, linear, not clamped)."""
    (x1, x2), (y1, y2) = LTX_SHIFT_TOKENS, LTX_SHIFT_MU
    slope = (y2 - y1) / (x2 - x1)
    return tokens * slope + (y1 - slope * x1)


class LTXFlowMatching(FlowMatching):
    """Rectified flow with LTX's resolution-dependent shift where no constant ``shift`` is configured;
    ``seq_len`` is the latent's token count (``LTXVideoAdapter.seq_len``)."""

    def shift_text(self):
        return super().shift_text() or "LTX's resolution-dependent shift (ComfyUI's ModelSamplingLTXV)"

    def _shift(self, t, seq_len):
        from comfy.model_sampling import time_snr_shift

        if self.shift is not None:
            return super()._shift(t, seq_len)
        # flux_time_shift(mu, 1, t) == time_snr_shift(e^mu, t)
        return time_snr_shift(math.exp(ltx_mu(seq_len)), t).float()


def key_mask(text_lengths: torch.Tensor, tokens: int, dtype: torch.dtype) -> torch.Tensor | None:
    """ComfyUI's additive cross-attention mask for zero-padded captions (LTXVModel._forward's conversion of
    an integer mask), [B, 1, 1, tokens]; None when no caption is padded."""
    if bool((text_lengths >= tokens).all()):
        return None
    mask = (torch.arange(tokens, device=text_lengths.device)[None] < text_lengths[:, None]).long()
    return (mask - 1).to(dtype).reshape(mask.shape[0], 1, -1, tokens) * torch.finfo(dtype).max


class LTXInput(TupleLayer):
    cost = 0.05

    def __init__(self, dm, objective, dtype, conditioning: tuple[str, ...] = ()):
        super().__init__()
        # only the embedders become children: the blocks belong to other layers
        self.patchify_proj, self.adaln_single = dm.patchify_proj, dm.adaln_single
        self.caption_projection = dm.caption_projection
        self.patchifier, self.inner_dim = dm.patchifier, dm.inner_dim
        self.vae_scale_factors, self.causal = dm.vae_scale_factors, dm.causal_temporal_positioning
        self.rope = rope_tables(dm)
        self.objective, self.dtype, self.conditioning = objective, dtype, conditioning

    def run(self, latents, noise, t, context, text_lengths, *conditioning):
        from comfy.ldm.lightricks.symmetric_patchifier import latent_to_pixel_coords

        cond = dict(zip(self.conditioning, conditioning))
        x_t = self.objective.noisy(latents, noise, t)
        timestep = self.objective.model_timestep(t)
        if "first_frame" in cond:   # LTXVImgToVideo: the first frame clean, its tokens at timestep 0
            x_t = torch.cat([cond["first_frame"].to(x_t.dtype), x_t[:, :, 1:]], dim=2)
            timestep = first_frame_token_timesteps(timestep, x_t.shape)
        x_t = x_t.to(self.dtype)
        size = torch.tensor(list(x_t.shape[2:]), device=x_t.device)
        x, latent_coords = self.patchifier.patchify(x_t)
        coords = latent_to_pixel_coords(latent_coords, self.vae_scale_factors, causal_fix=self.causal).float()
        coords[:, 0] = coords[:, 0] * (1.0 / LTX_FPS)
        x = self.patchify_proj(x)
        pe = pack_rope(self.rope(coords, x.dtype))
        b = x.shape[0]
        timestep, embedded = self.adaln_single(timestep.flatten() * 1000.0,
                                               {"resolution": None, "aspect_ratio": None}, batch_size=b,
                                               hidden_dtype=x.dtype)
        timestep = timestep.view(b, -1, timestep.shape[-1])
        embedded = embedded.view(b, -1, embedded.shape[-1])
        context = self.caption_projection(context.to(self.dtype)).view(b, -1, x.shape[-1])
        return with_grad(x), hide(context), hide(timestep), hide(embedded), hide(pe[0]), size, text_lengths


def first_frame_token_timesteps(timestep: torch.Tensor, shape) -> torch.Tensor:
    """[B, tokens]: ``timestep`` [B] for every token but those of the first latent frame, which get 0 -- what
    ComfyUI's ``LTXV.process_timestep`` makes of LTXVImgToVideo's noise mask (tokens in T, H, W order)."""
    b, _, frames, h, w = shape
    mask = torch.ones(1, frames, h * w, dtype=timestep.dtype, device=timestep.device)
    mask[:, 0] = 0
    return (timestep.reshape(b, 1, 1) * mask).flatten(1)


def rope_tables(dm):
    """``(pixel coordinates, dtype) -> RoPE tables`` as this ComfyUI builds them: the module function
    ``precompute_freqs_cis`` (to 0.7: one tensor, or a (cos, sin) pair before 0.3.7x), or the model's own
    ``_precompute_freqs_cis`` (0.8 on: the tables and whether they are split, ``pack_rope``)."""
    method = getattr(dm, "_precompute_freqs_cis", None)
    if method is not None:
        return lambda coords, dtype: method(coords, dim=dm.inner_dim, out_dtype=dtype,
                                            theta=dm.positional_embedding_theta,
                                            max_pos=dm.positional_embedding_max_pos,
                                            use_middle_indices_grid=dm.use_middle_indices_grid,
                                            num_attention_heads=dm.num_attention_heads)
    from comfy.ldm.lightricks.model import precompute_freqs_cis
    return lambda coords, dtype: precompute_freqs_cis(coords, dim=dm.inner_dim, out_dtype=dtype)


def rope_kind(dm) -> str:
    """How this ComfyUI's RoPE tables look (``pack_rope``), from one position."""
    return pack_rope(rope_tables(dm)(torch.zeros(1, 3, 1), torch.float32))[1]


def pack_rope(pe) -> tuple:
    """ComfyUI's RoPE tables as one tensor (what crosses a stage boundary) and their kind: ``tensor``, ``pair``
    (cos, sin), ``pair-split`` / ``pair-interleaved`` (cos, sin and the split flag: 0.8) or ``split`` / ``matrix``
    (a rotation matrix and its split flag: later releases)."""
    if isinstance(pe, torch.Tensor):
        return pe, "tensor"
    if len(pe) == 3:   # 0.8: (cos, sin, whether split)
        cos, sin, split = pe
        return torch.stack((cos, sin)), "pair-split" if split else "pair-interleaved"
    first, second = pe
    if isinstance(second, torch.Tensor):
        return torch.stack((first, second)), "pair"
    return first, "split" if second else "matrix"


def unpack_rope(pe: torch.Tensor, kind: str):
    if kind == "pair":
        return tuple(pe.unbind(0))
    if kind in ("pair-split", "pair-interleaved"):
        return (*pe.unbind(0), kind == "pair-split")
    if kind in ("split", "matrix"):
        return pe, kind == "split"
    return pe


def ltx_block(block, x, context, timestep, pe, mask, transformer_options):
    """ComfyUI's ``BasicTransformerBlock.forward`` with its in-place residuals written out of place."""
    from comfy.ldm.common_dit import rms_norm

    table = block.scale_shift_table
    mods = table[None, None].to(device=x.device, dtype=x.dtype) + timestep.reshape(
        x.shape[0], timestep.shape[1], table.shape[0], -1)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods.unbind(dim=2)
    h = rms_norm(x)
    h = torch.addcmul(h, h, scale_msa) + shift_msa
    x = torch.addcmul(x, block.attn1(h, pe=pe, transformer_options=transformer_options), gate_msa)
    x = x + block.attn2(x, context=context, mask=mask, transformer_options=transformer_options)
    y = rms_norm(x)
    y = torch.addcmul(y, y, scale_mlp) + shift_mlp
    return torch.addcmul(x, block.ff(y), gate_mlp)


class LTXBlock(BlockLayer):
    rope_kind = "tensor"   # how ComfyUI's RoPE tables cross stage boundaries (pack_rope), set by to_layers

    def block_forward(self, x, context, timestep, pe, text_lengths):
        context = reveal(context, self.dtype)
        pe = unpack_rope(reveal(pe, self.dtype), self.rope_kind)
        return ltx_block(self.block, x, context, reveal(timestep, self.dtype), pe,
                         key_mask(text_lengths, context.shape[1], x.dtype), sdpa_transformer_options())

    def run(self, x, context, timestep, embedded, pe, size, text_lengths):
        x = self.checkpointed(x, context, timestep, pe, text_lengths)
        return x, context, timestep, embedded, pe, size, text_lengths


class LTXOutput(TupleLayer):
    cost = 0.05

    def __init__(self, dm, dtype):
        super().__init__()
        self.norm_out, self.proj_out = dm.norm_out, dm.proj_out
        self.scale_shift_table = dm.scale_shift_table
        self.patchifier, self.out_channels, self.dtype = dm.patchifier, dm.out_channels, dtype

    def run(self, x, context, timestep, embedded, pe, size, text_lengths):
        embedded = reveal(embedded, self.dtype)
        mods = self.scale_shift_table[None, None].to(device=x.device, dtype=x.dtype) + embedded[:, :, None]
        shift, scale = mods[:, :, 0], mods[:, :, 1]
        x = self.norm_out(x)
        x = self.proj_out(torch.addcmul(x, x, scale) + shift)
        frames, h, w = (int(v) for v in size)
        out = self.patchifier.unpatchify(latents=x, output_height=h, output_width=w, output_num_frames=frames,
                                         out_channels=self.out_channels)
        return out.to(torch.promote_types(out.dtype, torch.float32))


class LTXVideoAdapter(VideoLatents, ModelAdapter):
    arch = "ltx_video"
    dp_aliases = ("ltx-video",)
    dp_single_file = True
    spec = LTXV_SPEC
    latent_format = "LTXV"
    lora_block_prefixes = ("transformer_blocks",)
    text_fields = ("cond",)
    text_lengths = True        # the layers mask the zero padding of the captions
    spatial_multiple = 32       # the VAE's 32x spatial compression, patch size 1
    framerate = LTX_FPS
    frame_multiple = 8          # clips of 8k + 1 frames (the VAE's causal 8x temporal compression)

    def encode_caption(self, clip, caption):
        """T5-XXL's hidden states of the caption's own tokens (ComfyUI zeroes and masks the padding)."""
        out = clip.encode_from_tokens(clip.tokenize(caption), return_dict=True)
        cond = out["cond"][0].float().cpu()
        mask = out.get("attention_mask")
        if mask is not None:
            cond = cond[:int(mask[0].sum())]
        return {"cond": cond}

    def seq_len(self, latent):
        """LTX's shift depends on all tokens of the clip: T x H x W (patch size 1)."""
        return math.prod(latent.shape[-3:])

    def objective(self):
        return LTXFlowMatching(sample_method=self.cfg.timestep_sample_method, sigmoid_scale=self.cfg.sigmoid_scale,
                               shift=self.cfg.shift, multiplier=1.0, min_t=self.cfg.min_t, max_t=self.cfg.max_t)

    def to_layers(self):
        dm = self.diffusion_model
        layers: list[nn.Module] = [LTXInput(dm, self.objective(), self.dtype, self.conditioning_fields)]
        blocks = [LTXBlock(b, self.dtype) for b in dm.transformer_blocks]
        kind = rope_kind(dm)
        for block in blocks:
            block.rope_kind = kind
        layers += blocks
        layers.append(LTXOutput(dm, self.dtype))
        return layers

    def empty_latent(self, width, height, frames=1):
        return torch.zeros(1, 128, self.latent_frames(frames), height // 32, width // 32)

    def probe_latent(self, generator, size=(8, 8)):
        return torch.randn(1, 128, 2, *size, generator=generator)

    def probe_text(self, generator):
        tokens = 16
        return [torch.randn(1, tokens, self.diffusion_model.caption_projection.linear_1.in_features,
                            generator=generator), torch.tensor([tokens])]

    def reference_forward(self, x_t, t, text):
        """ComfyUI's LTXVModel forward with the integer caption mask ComfyUI's T5 gives it."""
        cond, lengths = text
        return self._comfy_forward(x_t, self.objective().model_timestep(t), cond, lengths)

    def _comfy_forward(self, x, timestep, cond, lengths):
        mask = (torch.arange(cond.shape[1], device=cond.device)[None] < lengths[:, None].to(cond.device)).long()
        return self.diffusion_model(x.to(self.dtype), timestep, cond.to(self.dtype), attention_mask=mask,
                                    frame_rate=LTX_FPS)


class LTXVideoI2VAdapter(GivenFirstFrame, LTXVideoAdapter):
    """LTX-Video image to video: the clip's first frame given, as ComfyUI's LTXVImgToVideo (strength 1) gives it."""
    arch = "ltx_video_i2v"
    dp_first_frame_of = "ltx_video"
    dp_single_file = True   # the facts name one type each (registry.dp_facts): the i2v type reads the same files
    still_type = "ltx_video"

    def reference_forward(self, x_t, t, text):
        """ComfyUI's LTXV under LTXVImgToVideo: the first frame given, one timestep per token [B, tokens, 1]."""
        cond, lengths, first = text
        x = torch.cat([first.to(x_t.dtype), x_t[:, :, 1:]], dim=2)
        timestep = first_frame_token_timesteps(self.objective().model_timestep(t), x.shape)[..., None]
        return self._comfy_forward(x, timestep, cond, lengths)

    takes_start_image = True

    def start_conditioning(self, vae, positive, negative, width, height, frames, images):
        """ComfyUI's LTXVImgToVideo at strength 1: the start image's latent as the first latent frame, which the
        latent's noise mask keeps."""
        from ..host.runtime import comfy_nodes
        comfy_nodes()   # nodes_lt imports ComfyUI's ``nodes``: set up first, or this repository's package is found
        from comfy_extras.nodes_lt import LTXVImgToVideo

        return tuple(LTXVImgToVideo.execute(positive, negative, images[0], vae, width, height, frames, 1, 1.0).result)
