"""Wan 2.1 text-to-video through ComfyUI's ``comfy.ldm.wan.model.WanModel``.

Latents are 5-D [B, 16, T, H, W] from ComfyUI's Wan VAE (``comfy.ldm.wan.vae``: 8x spatial, 4x temporal
with a causal first frame, so a clip of 4k + 1 frames gives k + 1 latent frames); a still image is a
one-frame clip. Clips are resampled to Wan's 16 fps (``data/video.py``).

ComfyUI's ``WanAttentionBlock`` adds its residuals out of place, so the layers run ComfyUI's own blocks
(attention routed to SDPA); what is re-stated is only ``WanModel._forward``'s loop:

    WanInput        patch_embedding, RoPE table, time embedding and its 6 modulations, text_embedding
    WanBlock  xN    blocks[i](x, e0, freqs, context)            (x, e0, e, context, freqs, grid, size)
    WanOutput       head(x, e), unpatchify, crop

Everything but x comes from frozen weights or the data and travels bit-cast to integers. Training is
rectified flow (target noise - x0; ``shift`` as configured -- ComfyUI samples Wan with shift 8); the network
takes t x 1000, ComfyUI's ``ModelSamplingDiscreteFlow`` multiplier. The text is UMT5-XXL's, 512 tokens with
the padding zeroed, as ComfyUI encodes it. LoRA goes on every linear of the blocks (self- and
cross-attention q/k/v/o, feed-forward).
"""
from __future__ import annotations

import torch
from torch import nn

from .checkpointing import run_checkpointed
from .attention import sdpa_transformer_options
from .base import ModelAdapter
from .carry import TupleLayer, hide, reveal, with_grad
from .objectives import FlowMatching
from .spec import ArchSpec

WAN_FPS = 16


def wan_config(dim: int, ffn_dim: int, num_layers: int) -> dict:
    """The ``unet_config`` ComfyUI's detection derives from a Wan 2.1 t2v checkpoint (heads of 128)."""
    return {"image_model": "wan2.1", "dim": dim, "out_dim": 16, "num_heads": dim // 128, "ffn_dim": ffn_dim,
            "num_layers": num_layers, "patch_size": (1, 2, 2), "freq_dim": 256, "window_size": (-1, -1),
            "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6, "in_dim": 16, "model_type": "t2v"}


# full: Wan2.1-T2V-14B. tiny: 2 blocks at width 256 (2 heads of 128), which ComfyUI still detects.
WAN_CONFIGS = {"full": wan_config(5120, 13824, 40), "tiny": wan_config(256, 512, 2)}


def wan21_config(size: str) -> dict:
    return dict(WAN_CONFIGS["full" if size == "full" else "tiny"])


def build_wan(config: dict) -> nn.Module:
    from ..runtime import ensure_comfyui
    ensure_comfyui()
    import comfy.ldm.wan.model
    import comfy.ops
    return comfy.ldm.wan.model.WanModel(device="meta", operations=comfy.ops.disable_weight_init, **config)


def _wan_clip_target():
    import comfy.supported_models_base
    import comfy.text_encoders.wan
    return comfy.supported_models_base.ClipTarget(comfy.text_encoders.wan.WanT5Tokenizer, comfy.text_encoders.wan.te())


WAN_SPEC = ArchSpec(
    title="Wan 2.1 t2v", comfy_configs=("WAN21_T2V",), unet_config=wan21_config, build=build_wan,
    detected_sizes=("tiny", "full"), text_encoders=("umt5xxl",), clip_type="WAN", clip_target=_wan_clip_target,
    vae="wan21", example_file="wan2.1_t2v_14B_bf16.safetensors")


class WanInput(TupleLayer):
    cost = 0.05

    def __init__(self, dm, objective, dtype):
        super().__init__()
        # only the embedders become children: the blocks belong to other layers
        self.patch_embedding, self.text_embedding = dm.patch_embedding, dm.text_embedding
        self.time_embedding, self.time_projection = dm.time_embedding, dm.time_projection
        self.rope_embedder = dm.rope_embedder
        self._rope_encode = dm.rope_encode
        self.patch_size, self.freq_dim, self.dim = dm.patch_size, dm.freq_dim, dm.dim
        self.objective, self.dtype = objective, dtype

    def run(self, latents, noise, t, context):
        import comfy.ldm.common_dit
        from comfy.ldm.wan.model import sinusoidal_embedding_1d

        x = self.objective.noisy(latents, noise, t).to(self.dtype)
        b, _, frames, h, w = x.shape
        x = comfy.ldm.common_dit.pad_to_patch_size(x, self.patch_size)
        freqs = self._rope_encode(frames, h, w, device=x.device, dtype=x.dtype)
        x = self.patch_embedding(x.float()).to(x.dtype)
        grid = torch.tensor(x.shape[2:], device=x.device)
        x = x.flatten(2).transpose(1, 2)
        timestep = self.objective.model_timestep(t)
        e = self.time_embedding(sinusoidal_embedding_1d(self.freq_dim, timestep.flatten()).to(dtype=x.dtype))
        e = e.reshape(b, -1, e.shape[-1])
        e0 = self.time_projection(e).unflatten(2, (6, self.dim))
        context = self.text_embedding(context.to(self.dtype))
        size = torch.tensor([frames, h, w], device=x.device)
        return with_grad(x), hide(e0), hide(e), hide(context), hide(freqs.float()), grid, size


class WanBlock(TupleLayer):
    cost = 1.0

    def __init__(self, block, dtype, checkpoint_activations=False):
        super().__init__()
        self.block, self.dtype, self.checkpoint_activations = block, dtype, checkpoint_activations

    def block_forward(self, x, e0, context, freqs):
        return self.block(x, e=reveal(e0, self.dtype), freqs=reveal(freqs, torch.float32),
                          context=reveal(context, self.dtype), context_img_len=None,
                          transformer_options=sdpa_transformer_options())

    def run(self, x, e0, e, context, freqs, grid, size):
        if self.checkpoint_activations and torch.is_grad_enabled():
            x = run_checkpointed(self.checkpoint_activations, self.block_forward, x, e0, context, freqs)
        else:
            x = self.block_forward(x, e0, context, freqs)
        return x, e0, e, context, freqs, grid, size


class WanOutput(TupleLayer):
    cost = 0.05

    def __init__(self, dm, dtype):
        super().__init__()
        self.head, self.dtype = dm.head, dtype
        self._unpatchify = dm.unpatchify

    def run(self, x, e0, e, context, freqs, grid, size):
        out = self._unpatchify(self.head(x, reveal(e, self.dtype)), [int(g) for g in grid])
        frames, h, w = (int(v) for v in size)
        out = out[:, :, :frames, :h, :w]
        return out.to(torch.promote_types(out.dtype, torch.float32))


class WanAdapter(ModelAdapter):
    arch = "wan"
    spec = WAN_SPEC
    latent_format = "Wan21"
    lora_block_prefixes = ("blocks",)
    text_fields = ("context",)
    framerate = WAN_FPS
    frame_multiple = 4          # clips of 4k + 1 frames (the VAE's causal 4x temporal compression)

    def encode_images(self, vae, pixels):
        """Each image as a one-frame clip: [B, H, W, 3] -> [B, 16, 1, h, w] (ComfyUI's Wan VAE would take a
        batch of images as the frames of one video)."""
        return torch.cat([self.encode_video(vae, pixels[i:i + 1])[None] for i in range(pixels.shape[0])])

    def encode_video(self, vae, frames):
        import comfy.latent_formats
        fmt = getattr(comfy.latent_formats, self.latent_format)()
        return fmt.process_in(vae.encode(frames).float()).cpu()[0]

    def encode_caption(self, clip, caption):
        tokens = clip.tokenize(caption)
        out = clip.encode_from_tokens(tokens, return_dict=True)
        return {"context": out["cond"][0].float().cpu()}

    def objective(self):
        multiplier = self.model_sampling.multiplier if self.patcher is not None else 1000.0
        return FlowMatching.from_model_config(self.cfg, multiplier=multiplier)

    def to_layers(self, checkpoint_activations=False):
        dm = self.diffusion_model
        layers: list[nn.Module] = [WanInput(dm, self.objective(), self.dtype)]
        layers += [WanBlock(b, self.dtype, checkpoint_activations) for b in dm.blocks]
        layers.append(WanOutput(dm, self.dtype))
        return layers

    def empty_latent(self, width, height):
        return torch.zeros(1, 16, 1, height // 8, width // 8)   # one frame: epoch samples are stills

    def probe_latent(self, generator, size=(8, 8)):
        return torch.randn(1, 16, 2, *size, generator=generator)

    def probe_text(self, generator):
        return [torch.randn(1, 16, self.diffusion_model.text_dim, generator=generator)]

    def reference_forward(self, x_t, t, text):
        (context,) = text
        return self.diffusion_model(x_t.to(self.dtype), self.objective().model_timestep(t), context.to(self.dtype))
