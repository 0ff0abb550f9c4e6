"""Wan 2.1 / 2.2 14B (text-to-video and image-to-video) through ComfyUI's ``comfy.ldm.wan.model.WanModel``.

Latents are 5-D [B, 16, T, H, W] from ComfyUI's Wan VAE (``comfy.ldm.wan.vae``: 8x spatial, 4x temporal
with a causal first frame, so a clip of 4k + 1 frames gives k + 1 latent frames); a still image is a
one-frame clip. Clips are resampled to Wan's 16 fps (``data/video.py``).

ComfyUI's ``WanAttentionBlock`` adds its residuals out of place, so the layers run ComfyUI's own blocks
(attention routed to SDPA); what is re-stated is only ``WanModel._forward``'s loop:

    WanInput        patch_embedding, RoPE table, time embedding and its 6 modulations, text_embedding
                    (i2v: the conditioning channels concatenated to the noisy latent, the CLIP-vision tokens
                    put before the text)
    WanBlock  xN    blocks[i](x, e0, freqs, context)            (x, e0, e, context, freqs, grid, size)
    WanOutput       head(x, e), unpatchify, crop

Everything but x comes from frozen weights or the data and travels bit-cast to integers. Training is
rectified flow (target noise - x0; ``shift`` as configured -- ComfyUI samples Wan with shift 8); the network
takes t x 1000, ComfyUI's ``ModelSamplingDiscreteFlow`` multiplier. ``min_t`` / ``max_t`` restrict the
timesteps to a range of that (shifted) distribution, as the two experts of Wan 2.2 14B divide the range
(``FlowMatching``). The text is UMT5-XXL's, 512 tokens with the padding zeroed, as ComfyUI encodes it.
LoRA goes on every linear of the blocks (self- and cross-attention q/k/v/o, i2v's k_img/v_img, feed-forward).

Types: ``wan`` -- Wan 2.1 t2v (1.3B, 14B) and the Wan 2.2 14B t2v experts (same network, ComfyUI's
WAN21_T2V); ``wan_i2v`` -- Wan 2.1 i2v 14B (WAN21_I2V, with CLIP-vision tokens) and Wan 2.2 i2v 14B
(WAN21_T2V with 36 input channels, no CLIP vision); ``wan_flf2v`` -- Wan 2.1 first-last-frame 14B (WAN21_I2V
whose CLIP-vision projection has a position embedding for the two frames' tokens, ``img_emb.emb_pos``).
Wan 2.2 TI2V 5B is ``wan22.py``.
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import ModelError
from .attention import sdpa_transformer_options
from .base import ModelAdapter, VideoLatents
from .carry import TupleLayer, hide, reveal, sizes, with_grad
from .checkpointing import BlockLayer
from .spec import ArchSpec, comfy_diffusion_model

WAN_FPS = 16


def wan_config(dim: int, ffn_dim: int, num_layers: int, in_dim: int = 16, out_dim: int = 16,
               model_type: str = "t2v") -> dict:
    """The ``unet_config`` ComfyUI's detection derives from a Wan checkpoint (heads of 128)."""
    return {"image_model": "wan2.1", "dim": dim, "out_dim": out_dim, "num_heads": dim // 128, "ffn_dim": ffn_dim,
            "num_layers": num_layers, "patch_size": (1, 2, 2), "freq_dim": 256, "window_size": (-1, -1),
            "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6, "in_dim": in_dim, "model_type": model_type}


# full: Wan2.1-T2V-14B (= each Wan2.2-T2V-A14B expert). tiny: 2 blocks at width 256 (2 heads of 128), which
# ComfyUI still detects.
WAN_CONFIGS = {"full": wan_config(5120, 13824, 40), "tiny": wan_config(256, 512, 2)}
# i2v: 16 latent + 4 mask + 16 image-latent channels in. Wan 2.1 has the CLIP-vision projection (img_emb) and
# ComfyUI calls it i2v; Wan 2.2's experts have none and ComfyUI detects them as t2v with 36 channels.
WAN_I2V_CONFIGS = {
    "full": wan_config(5120, 13824, 40, in_dim=36, model_type="i2v"),
    "tiny": wan_config(256, 512, 2, in_dim=36, model_type="i2v"),
    "full_22": wan_config(5120, 13824, 40, in_dim=36),
    "tiny_22": wan_config(256, 512, 2, in_dim=36),
}
# flf2v: Wan 2.1 i2v plus img_emb.emb_pos over the first and the last frame's CLIP-vision tokens (2 x 257), from
# which ComfyUI's detection reads flf_pos_embed_token_number
WAN_FLF2V_CONFIGS = {size: {**WAN_I2V_CONFIGS[size], "flf_pos_embed_token_number": 2 * 257}
                     for size in ("tiny", "full")}


def wan21_config(size: str) -> dict:
    return dict(WAN_CONFIGS["full" if size == "full" else "tiny"])


def wan_i2v_config(size: str) -> dict:
    return dict(WAN_I2V_CONFIGS["full" if size == "full" else "tiny"])


def wan_flf2v_config(size: str) -> dict:
    return dict(WAN_FLF2V_CONFIGS["full" if size == "full" else "tiny"])


build_wan = comfy_diffusion_model("comfy.ldm.wan.model:WanModel")


WAN_SPEC = ArchSpec(
    title="Wan 2.1 / 2.2 14B t2v", comfy_configs=("WAN21_T2V",), unet_config=wan21_config, build=build_wan,
    detected_sizes=("tiny", "full"), text_encoders=("umt5xxl",), clip_type="WAN", vae="wan21",
    example_file="wan2.1_t2v_14B_bf16.safetensors", accepts=lambda c: c.get("in_dim") == 16)

WAN_I2V_SPEC = ArchSpec(
    title="Wan 2.1 / 2.2 14B i2v", comfy_configs=("WAN21_I2V", "WAN21_T2V"), unet_config=wan_i2v_config,
    build=build_wan, detected_sizes=("tiny", "full"), text_encoders=("umt5xxl",), clip_type="WAN",
    vae="wan21", example_file="wan2.2_i2v_high_noise_14B_fp16.safetensors",
    accepts=lambda c: c.get("in_dim") == 36 and "flf_pos_embed_token_number" not in c)

WAN_FLF2V_SPEC = ArchSpec(
    title="Wan 2.1 14B first-last-frame", comfy_configs=("WAN21_I2V",), unet_config=wan_flf2v_config,
    build=build_wan, detected_sizes=("tiny", "full"), text_encoders=("umt5xxl",), clip_type="WAN",
    vae="wan21", example_file="wan2.1_flf2v_720p_14B_fp16.safetensors",
    accepts=lambda c: "flf_pos_embed_token_number" in c)


class WanInput(TupleLayer):
    """``conditioning``: the names of the tensors after the text (``WanAdapter.conditioning_fields``):
    ``concat`` (i2v: mask + image-latent channels), ``clip_fea`` (Wan 2.1 i2v: CLIP-vision tokens),
    ``first_frame`` (Wan 2.2 5B ti2v: the clean first latent frame, taken as given at timestep 0)."""
    cost = 0.05

    def __init__(self, dm, objective, dtype, conditioning: tuple[str, ...] = ()):
        super().__init__()
        # only the embedders become children: the blocks belong to other layers
        self.patch_embedding, self.text_embedding = dm.patch_embedding, dm.text_embedding
        self.time_embedding, self.time_projection = dm.time_embedding, dm.time_projection
        self.rope_embedder = dm.rope_embedder
        self.img_emb = dm.img_emb   # Wan 2.1 i2v's CLIP-vision projection; None in the other variants
        self._rope_encode = dm.rope_encode
        self.patch_size, self.freq_dim, self.dim = dm.patch_size, dm.freq_dim, dm.dim
        self.objective, self.dtype, self.conditioning = objective, dtype, conditioning

    def run(self, latents, noise, t, context, *conditioning):
        return self.carried(*self.embed(latents, noise, t, context, *conditioning))

    @staticmethod
    def carried(x, e0, e, context, freqs, grid, size):
        """What the blocks receive: the tokens with a graph, the frozen tensors hidden (``carry``)."""
        return with_grad(x), hide(e0), hide(e), hide(context), hide(freqs.float()), grid, size

    def embed(self, latents, noise, t, context, *conditioning):
        """The embedded tokens, modulations, text, RoPE table, grid and sizes, none of them hidden yet."""
        import comfy.ldm.common_dit
        from comfy.ldm.wan.model import sinusoidal_embedding_1d

        cond = dict(zip(self.conditioning, conditioning))
        x = self.objective.noisy(latents, noise, t)
        timestep = self.objective.model_timestep(t)
        if "first_frame" in cond:   # ComfyUI's ti2v: the first frame clean, its timestep 0 (WAN22.process_timestep)
            x = torch.cat([cond["first_frame"].to(x.dtype), x[:, :, 1:]], dim=2)
            timestep = timestep[:, None] * first_frame_mask(x.shape[2], timestep)
        x = x.to(self.dtype)
        b, _, frames, h, w = x.shape
        if "concat" in cond:
            x = torch.cat([x, cond["concat"].to(self.dtype)], dim=1)
        x = comfy.ldm.common_dit.pad_to_patch_size(x, self.patch_size)
        freqs = self._rope_encode(frames, h, w, device=x.device, dtype=x.dtype)
        x = self.patch_embedding(x.float()).to(x.dtype)
        grid = torch.tensor(x.shape[2:], device=x.device)
        x = x.flatten(2).transpose(1, 2)
        e = self.time_embedding(sinusoidal_embedding_1d(self.freq_dim, timestep.flatten()).to(dtype=x.dtype))
        e = e.reshape(b, -1, e.shape[-1])
        e0 = self.time_projection(e).unflatten(2, (6, self.dim))
        context = self.text_embedding(context.to(self.dtype))
        image_tokens = 0
        if "clip_fea" in cond:    # as ComfyUI: a model without img_emb (Wan 2.2) ignores the CLIP tokens
            clip = cond["clip_fea"].to(self.dtype)
            if self.img_emb is not None:
                context = torch.cat([self.img_emb(clip), context], dim=1)
            image_tokens = clip.shape[-2]
        return x, e0, e, context, freqs, grid, sizes(frames, h, w, image_tokens)


def first_frame_mask(frames: int, like: torch.Tensor) -> torch.Tensor:
    """[1, frames]: 0 for the given first latent frame, 1 for the frames to denoise."""
    mask = torch.ones(1, frames, dtype=like.dtype, device=like.device)
    mask[:, 0] = 0
    return mask


class WanBlock(BlockLayer):
    def block_forward(self, x, e0, context, freqs, image_tokens):
        return self.block(x, e=reveal(e0, self.dtype), freqs=reveal(freqs, torch.float32),
                          context=reveal(context, self.dtype), context_img_len=image_tokens or None,
                          transformer_options=sdpa_transformer_options())

    def run(self, x, e0, e, context, freqs, grid, size):
        image_tokens = int(size[3])
        x = self.checkpointed(x, e0, context, freqs, image_tokens)
        return x, e0, e, context, freqs, grid, size


class WanOutput(TupleLayer):
    cost = 0.05

    def __init__(self, dm, dtype):
        super().__init__()
        self.head, self.dtype = dm.head, dtype
        self._unpatchify = dm.unpatchify

    def run(self, x, e0, e, context, freqs, grid, size):
        out = self._unpatchify(self.head(x, reveal(e, self.dtype)), [int(g) for g in grid])
        frames, h, w = (int(v) for v in size[:3])
        out = out[:, :, :frames, :h, :w]
        return out.to(torch.promote_types(out.dtype, torch.float32))


def nodes_wan():
    """ComfyUI's ``comfy_extras.nodes_wan`` (it imports ComfyUI's own ``nodes``, set up first: imported bare, this
    repository's ``nodes`` package may be found in its place)."""
    from ..host.runtime import comfy_nodes
    comfy_nodes()
    import comfy_extras.nodes_wan
    return comfy_extras.nodes_wan


class WanAdapter(VideoLatents, ModelAdapter):
    dp_ckpt_folder = True
    arch = "wan"
    spec = WAN_SPEC
    latent_format = "Wan21"
    lora_block_prefixes = ("blocks",)
    text_fields = ("context",)
    framerate = WAN_FPS
    frame_multiple = 4          # clips of 4k + 1 frames (the VAE's causal 4x temporal compression)
    latent_channels = 16
    vae_scale = 8               # pixels per latent side

    def encode_caption(self, clip, caption):
        tokens = clip.tokenize(caption)
        out = clip.encode_from_tokens(tokens, return_dict=True)
        return {"context": out["cond"][0].float().cpu()}

    def objective(self):
        return self.flow_matching(default_multiplier=1000.0)

    def to_layers(self):
        dm = self.diffusion_model
        layers: list[nn.Module] = [WanInput(dm, self.objective(), self.dtype, self.conditioning_fields)]
        layers += [WanBlock(b, self.dtype) for b in dm.blocks]
        layers.append(WanOutput(dm, self.dtype))
        return layers

    def empty_latent(self, width, height, frames=1):
        return torch.zeros(1, self.latent_channels, self.latent_frames(frames), height // self.vae_scale,
                           width // self.vae_scale)

    def probe_latent(self, generator, size=(8, 8)):
        return torch.randn(1, self.latent_channels, 2, *size, generator=generator)

    def probe_text(self, generator):
        """The caption, then any conditioning fields (``check_lora`` hands both to the layers and ComfyUI)."""
        return [torch.randn(1, 16, self.diffusion_model.text_dim, generator=generator)]

    def reference_forward(self, x_t, t, text):
        (context,) = text
        return self.diffusion_model(x_t.to(self.dtype), self.objective().model_timestep(t), context.to(self.dtype))


# --- image to video (14B) -------------------------------------------------------------------------
CLIP_VISION_TOKENS, CLIP_VISION_WIDTH = 257, 1280   # ViT-H/14 at 224 px: 16 x 16 patches + class token


class WanI2VAdapter(WanAdapter):
    """Wan 2.1 / 2.2 14B image-to-video: the clip's first frame conditions the rest, as ComfyUI's
    ``WanImageToVideo`` gives it: ``concat`` = [4-channel mask (1 on the first latent frame), the latent of
    the first frame followed by mid-grey frames] concatenated to the noisy latent's channels; Wan 2.1 also
    takes the first frame's CLIP-vision penultimate tokens (``clip_fea``, from [model] clip_vision, as
    ``CLIPVisionEncode`` with crop 'none' gives them)."""
    arch = "wan_i2v"
    spec = WAN_I2V_SPEC
    takes_clip_vision = True

    def __init__(self, cfg, *args, **kwargs):
        super().__init__(cfg, *args, **kwargs)
        self.conditioning_fields = ("concat", "clip_fea") if cfg.clip_vision else ("concat",)
        self._clip_vision = None

    def model_files(self):
        files = super().model_files()
        if self.cfg.clip_vision:
            files["conditioning"] = [self._clip_vision_file()]   # its fingerprint enters the conditioning's keys
        return files

    def _clip_vision_file(self):
        path = self.resolve(self.cfg.clip_vision)
        if not path.is_file():
            raise ModelError(f"[model] clip_vision: file not found: {path}")
        return path

    given_last_frame = False    # wan_flf2v: the clip's last frame is given too
    concat_channels = 20        # mask 4 + image latent 16

    def encode_conditioning(self, vae, media, control):
        import comfy.latent_formats
        if media.shape[0] < 2:
            raise ModelError(f"{self.arch} trains on videos only (the given frames condition the others); "
                             "this dataset has a still image: move images to another run or give clips")
        image = torch.full_like(media, 0.5)
        image[:1] = media[:1]
        if self.given_last_frame:
            image[-1:] = media[-1:]
        latent = comfy.latent_formats.Wan21().process_in(vae.encode(image).float()).cpu()[0]
        mask = torch.zeros(4, *latent.shape[1:])
        mask[:, 0] = 1.0
        if self.given_last_frame:
            # ComfyUI's mask is per pixel frame, the first one standing for 4, folded 4 to a latent frame: the
            # clip's last pixel frame is the last latent frame's 4th mask channel alone (as the Wan reference does)
            mask[3, -1] = 1.0
        out = {"concat": torch.cat([mask, latent])}
        if "clip_fea" in self.conditioning_fields:
            frames = [media[:1], media[-1:]] if self.given_last_frame else [media[:1]]
            # WanFirstLastFrameToVideo: the two frames' tokens concatenated, first frame first
            out["clip_fea"] = torch.cat([self.encode_clip_vision(f) for f in frames], dim=-2)
        return out

    def encode_clip_vision(self, image: torch.Tensor) -> torch.Tensor:
        """The penultimate hidden states [257, 1280] ComfyUI's CLIPVisionEncode (crop 'none') gives."""
        return self.clip_vision_output(image)["penultimate_hidden_states"][0].float().cpu()

    def clip_vision_output(self, image: torch.Tensor):
        """ComfyUI's CLIPVisionEncode (crop 'none') of ``image`` [1, H, W, 3]: its CLIP_VISION_OUTPUT."""
        from .loading import load_clip_vision
        if self._clip_vision is None:
            self._clip_vision = load_clip_vision(self._clip_vision_file())
        return self._clip_vision.encode_image(image, crop=False)

    takes_start_image = True

    def start_conditioning(self, vae, positive, negative, width, height, frames, images):
        """ComfyUI's WanImageToVideo (wan_flf2v: WanFirstLastFrameToVideo, the second image the end frame), with
        CLIPVisionEncode's output of each image where [model] clip_vision names a file."""
        nodes = nodes_wan()
        vision = [self.clip_vision_output(i) for i in images] if self.cfg.clip_vision else [None] * len(images)
        if self.given_last_frame:
            start, end = (images + [None])[:2]
            out = nodes.WanFirstLastFrameToVideo.execute(positive, negative, vae, width, height, frames, 1,
                                                         start_image=start, end_image=end,
                                                         clip_vision_start_image=vision[0],
                                                         clip_vision_end_image=(vision + [None])[1])
        else:
            out = nodes.WanImageToVideo.execute(positive, negative, vae, width, height, frames, 1,
                                                start_image=images[0], clip_vision_output=vision[0])
        return tuple(out.result)

    def probe_text(self, generator):
        b, t, h, w = 1, 2, 8, 8
        concat = torch.randn(b, self.concat_channels, t, h, w, generator=generator)
        out = [*super().probe_text(generator), concat]
        if "clip_fea" in self.conditioning_fields:
            tokens = CLIP_VISION_TOKENS * (2 if self.given_last_frame else 1)
            out.append(torch.randn(b, tokens, CLIP_VISION_WIDTH, generator=generator))
        return out

    def reference_forward(self, x_t, t, text):
        context, concat, *clip = text
        x = torch.cat([x_t, concat], dim=1).to(self.dtype)
        clip_fea = clip[0].to(self.dtype) if clip else None
        return self.diffusion_model(x, self.objective().model_timestep(t), context.to(self.dtype), clip_fea=clip_fea)


class WanFLF2VAdapter(WanI2VAdapter):
    """Wan 2.1 first-last-frame-to-video 14B: the clip's first and last frames condition the frames between, as
    ComfyUI's ``WanFirstLastFrameToVideo`` gives them: ``concat`` = [mask, the latent of (first frame, mid-grey
    frames, last frame)], ``clip_fea`` = both frames' CLIP-vision tokens [514, 1280] (first, then last), which
    the model's ``img_emb`` offsets by its position embedding before the projection."""
    arch = "wan_flf2v"
    spec = WAN_FLF2V_SPEC
    given_last_frame = True
