"""HunyuanVideo, HunyuanVideo 1.5 and HunyuanImage 2.1 through ComfyUI's ``comfy.ldm.hunyuan_video`` model.

All three are ComfyUI's ``HunyuanVideo`` class with different configs: Flux-style double-stream blocks, then
(HunyuanVideo, HunyuanImage 2.1) single-stream blocks, over image tokens and text tokens that a small
transformer ("token refiner", ``txt_in``) prepares from the LLM's hidden states. ComfyUI's blocks add their
residuals in place, so the layers re-state them out of place (``flux.double_block`` / ``flux.single_block``,
which Flux and Chroma use too) while calling ComfyUI's submodules:

    HunyuanInput        patch embedding, timestep (+ CLIP-L pooled, + distilled guidance) vector, the token
                        refiner, glyph (byT5) tokens, RoPE              -> (img, txt, vec, pe, size, txt_valid)
    HunyuanDouble  xN   double_blocks[i]
    HunyuanJoin         cat(txt, img)
    HunyuanSingle  xM   single_blocks[i]                                (HunyuanVideo 1.5 has none)
    HunyuanOutput       final_layer, unpatchify

ComfyUI orders the joint sequence (img, txt) -- HunyuanVideo 1.5 puts the glyph tokens first -- while the
layers use (txt, img) like Flux; text tokens all sit at RoPE position 0, so attention gives the same result.
Captions are zero-padded to the longest in a micro-batch and ``txt_valid`` marks the real tokens: the padding
is masked as keys in the refiner and the blocks, and the refiner's mean over the caption counts real tokens
only, so each sample trains as it would alone, which is how ComfyUI runs it (one unpadded conditioning).

Training is rectified flow (target noise - x0) with ComfyUI's sampling shift for the model unless ``shift``
is set; the network takes t x 1000 (ComfyUI's ``ModelSamplingDiscreteFlow``). LoRA goes on every linear of
the double and single blocks (attention qkv/proj, MLPs, modulations), but those whose output reaches
nothing (HunyuanVideo 1.5's last block's text projection and MLP).
"""
from __future__ import annotations

import torch
from torch import nn

from .attention import sdpa_transformer_options
from .base import ModelAdapter
from .carry import TupleLayer, hide, reveal, with_grad
from .checkpointing import CheckpointedLayer
from .flux import double_block, single_block
from .spec import ArchSpec, comfy_diffusion_model

HUNYUAN_FPS = 24
GLYPH_WIDTH = 1472           # byT5-small glyph's hidden size (ComfyUI's ByT5Mapper in_dim)


def hunyuan_config(hidden: int, depth: int, single: int, context: int, **over) -> dict:
    """The ``unet_config`` ComfyUI's detection derives from a HunyuanVideo-family checkpoint (heads of 128)."""
    return {"image_model": "hunyuan_video", "in_channels": 16, "out_channels": 16, "patch_size": [1, 2, 2],
            "vec_in_dim": 768, "axes_dim": [16, 56, 56], "meanflow": False, "context_in_dim": context,
            "hidden_size": hidden, "mlp_ratio": 4.0, "num_heads": hidden // 128, "depth": depth,
            "depth_single_blocks": single, "theta": 256, "qkv_bias": True, "byt5": False, "guidance_embed": True,
            "use_cond_type_embedding": False, "vision_in_dim": None, **over}


# HunyuanVideo t2v (13B). tiny: 2 + 2 blocks at width 256 (2 heads of 128) over a 64-wide tiny LLaMA;
# ComfyUI still detects it (it reads the width, the depths and the text width from the weights).
HV_CONFIGS = {"full": hunyuan_config(3072, 20, 40, 4096), "tiny": hunyuan_config(256, 2, 2, 64)}
# HunyuanVideo 1.5 t2v (8.3B): double blocks only, 32-channel latents of its 16x VAE patched 1x1x1, the latent
# input concatenated with an (i2v) image latent and mask, Qwen2.5-VL text plus byT5 glyph tokens.
_HV15 = dict(in_channels=65, out_channels=32, patch_size=[1, 1, 1], vec_in_dim=None, byt5=True,
             guidance_embed=False, use_cond_type_embedding=True, vision_in_dim=1152)
HV15_CONFIGS = {"full": hunyuan_config(2048, 54, 0, 3584, **_HV15), "tiny": hunyuan_config(256, 2, 0, 64, **_HV15)}
# HunyuanImage 2.1 (17B): 2-D, 64-channel latents of its 32x VAE patched 1x1, Qwen2.5-VL + byT5 glyph tokens.
_HI21 = dict(in_channels=64, out_channels=64, patch_size=[1, 1], vec_in_dim=None, axes_dim=[64, 64], byt5=True,
             guidance_embed=False)
HI21_CONFIGS = {"full": hunyuan_config(3584, 20, 40, 3584, **_HI21), "tiny": hunyuan_config(256, 2, 2, 64, **_HI21)}


def _sizes(configs: dict):
    return lambda size: {**configs["full" if size == "full" else "tiny"]}


build_hunyuan = comfy_diffusion_model("comfy.ldm.hunyuan_video.model:HunyuanVideo")


HV_SPEC = ArchSpec(
    title="HunyuanVideo", comfy_configs=("HunyuanVideo",), unet_config=_sizes(HV_CONFIGS), build=build_hunyuan,
    detected_sizes=("tiny", "full"), text_encoders=("llama", "clip_l"), clip_type="HUNYUAN_VIDEO",
    vae="hunyuan_video", example_file="hunyuan_video_t2v_720p_bf16.safetensors")

HV15_SPEC = ArchSpec(
    title="HunyuanVideo 1.5", comfy_configs=("HunyuanVideo15",), unet_config=_sizes(HV15_CONFIGS),
    build=build_hunyuan, detected_sizes=("tiny", "full"), text_encoders=("qwen25_7b", "byt5_small"),
    clip_type="HUNYUAN_VIDEO_15",
    vae="hunyuan_video_15", example_file="hunyuanvideo1.5_720p_t2v_fp16.safetensors")

HI21_SPEC = ArchSpec(
    title="HunyuanImage 2.1", comfy_configs=("HunyuanImage21",), unet_config=_sizes(HI21_CONFIGS),
    build=build_hunyuan, detected_sizes=("tiny", "full"), text_encoders=("qwen25_7b", "byt5_small"),
    clip_type="HUNYUAN_IMAGE",
    vae="hunyuan_image_21", example_file="hunyuanimage2.1_bf16.safetensors")


def _key_mask(txt_valid: torch.Tensor, img_len: int):
    """Boolean key mask [B, 1, 1, txt + img] over a (txt, img) sequence; None when nothing is padded."""
    if bool(txt_valid.all()):
        return None
    img = torch.ones(txt_valid.shape[0], img_len, dtype=torch.bool, device=txt_valid.device)
    return torch.cat((txt_valid.bool(), img), 1)[:, None, None, :]


class HunyuanInput(TupleLayer):
    cost = 0.1

    def __init__(self, dm, objective, dtype, guidance: float):
        super().__init__()
        # only the input modules become children: the blocks belong to other layers
        self.img_in, self.time_in, self.txt_in, self.pe_embedder = dm.img_in, dm.time_in, dm.txt_in, dm.pe_embedder
        self.vector_in, self.guidance_in, self.byt5_in = dm.vector_in, dm.guidance_in, dm.byt5_in
        self.cond_type_embedding = dm.cond_type_embedding
        self._img_ids = dm.img_ids if len(dm.patch_size) == 3 else dm.img_ids_2d
        self.params, self.objective, self.dtype, self.guidance = dm.params, objective, dtype, guidance

    def model_input(self, x):
        """HunyuanVideo 1.5 takes an i2v image latent and mask beside the noisy latent: zeros for t2v, as
        ComfyUI's ``concat_cond`` gives them without an image."""
        extra = self.img_in.proj.weight.shape[1] - x.shape[1]
        return x if extra <= 0 else torch.cat((x, x.new_zeros(x.shape[0], extra, *x.shape[2:])), 1)

    def vector(self, timestep, pooled, like):
        from comfy.ldm.flux.layers import timestep_embedding

        vec = self.time_in(timestep_embedding(timestep, 256, time_factor=1.0).to(like))
        if self.vector_in is not None:
            vec = vec + self.vector_in(pooled.to(like)[:, :self.params.vec_in_dim])
        if self.params.guidance_embed:
            g = torch.full_like(timestep, self.guidance)
            vec = vec + self.guidance_in(timestep_embedding(g, 256).to(like))
        return vec

    def refine(self, tokens, lengths, timestep):
        """``TokenRefiner.forward`` for zero-padded captions: the pooled mean over each caption's own tokens,
        the padding masked as keys."""
        from comfy.ldm.flux.layers import timestep_embedding

        refiner = self.txt_in
        valid = torch.arange(tokens.shape[1], device=tokens.device)[None] < lengths[:, None]
        mask = None if bool(valid.all()) else valid[:, None, None, :]
        t = refiner.t_embedder(timestep_embedding(timestep, 256, time_factor=1.0).to(tokens))
        mean = tokens.sum(dim=1) / lengths[:, None].to(tokens)
        c = t + refiner.c_embedder(mean)
        x = refiner.input_embedder(tokens)
        for block in refiner.individual_token_refiner.blocks:
            x = block(x, c, mask, transformer_options=sdpa_transformer_options())
        return x, valid

    def text(self, timestep, text_fields, lengths):
        """(text tokens [B, L, hidden], which are real [B, L]) from the cached fields: the LLM's hidden states,
        then (HunyuanVideo 1.5, HunyuanImage 2.1) the byT5 glyph tokens."""
        txt, valid = self.refine(text_fields[0].to(self.dtype), lengths[:, 0], timestep)
        if self.cond_type_embedding is not None:
            txt = txt + self.cond_type_embedding.weight[0].to(txt)
        if self.byt5_in is not None:
            glyph = text_fields[1]
            glyph_valid = torch.arange(glyph.shape[1], device=glyph.device)[None] < lengths[:, 1:2]
            glyph = self.byt5_in(glyph.to(self.dtype))
            if self.cond_type_embedding is not None:
                glyph = glyph + self.cond_type_embedding.weight[1].to(glyph)
            txt, valid = torch.cat((txt, glyph), 1), torch.cat((valid, glyph_valid), 1)
        return txt, valid

    def run(self, latents, noise, t, *text):
        *fields, lengths = text
        x = self.objective.noisy(latents, noise, t).to(self.dtype)
        timestep = self.objective.model_timestep(t)   # embedded in float32, as ComfyUI does
        img = self.img_in(self.model_input(x))
        img_ids = self._img_ids(x)
        vec = self.vector(timestep, fields[1] if self.vector_in is not None else None, img)
        txt, valid = self.text(timestep, fields, lengths)
        txt_ids = torch.zeros(x.shape[0], txt.shape[1], img_ids.shape[-1], device=x.device, dtype=img_ids.dtype)
        pe = self.pe_embedder(torch.cat((txt_ids, img_ids), dim=1))
        size = torch.tensor(list(x.shape[2:]), device=x.device)
        return with_grad(img.contiguous()), with_grad(txt), hide(vec), hide(pe.float()), size, valid.long()


class HunyuanDouble(CheckpointedLayer):
    cost = 1.0

    def __init__(self, block, dtype):
        super().__init__()
        self.block, self.dtype = block, dtype

    def block_forward(self, img, txt, vec, pe, size, txt_valid):
        blk = self.block
        v = reveal(vec, self.dtype)
        img, txt = double_block(blk, img, txt, (*blk.img_mod(v), *blk.txt_mod(v)), reveal(pe, torch.float32),
                                _key_mask(txt_valid, img.shape[1]))
        return img, txt, vec, pe, size, txt_valid


class HunyuanJoin(TupleLayer):
    cost = 0.0

    def run(self, img, txt, vec, pe, size, txt_valid):
        return torch.cat((txt, img), 1), vec, pe, size, txt_valid


class HunyuanSingle(CheckpointedLayer):
    cost = 1.0

    def __init__(self, block, dtype):
        super().__init__()
        self.block, self.dtype = block, dtype

    def block_forward(self, x, vec, pe, size, txt_valid):
        mod, _ = self.block.modulation(reveal(vec, self.dtype))
        mask = _key_mask(txt_valid, x.shape[1] - txt_valid.shape[1])
        return single_block(self.block, x, mod, reveal(pe, torch.float32), mask), vec, pe, size, txt_valid


class HunyuanOutput(TupleLayer):
    cost = 0.05

    def __init__(self, dm, dtype):
        super().__init__()
        self.final_layer, self.patch_size, self.out_channels, self.dtype = (
            dm.final_layer, list(dm.patch_size), dm.out_channels, dtype)

    def run(self, x, vec, pe, size, txt_valid):
        img = self.final_layer(x[:, txt_valid.shape[1]:], reveal(vec, self.dtype))
        return unpatchify(img, [int(s) for s in size], self.patch_size, self.out_channels)


def unpatchify(img: torch.Tensor, size: list[int], patch: list[int], channels: int) -> torch.Tensor:
    """Tokens [B, N, C x prod(patch)] -> latents [B, C, *size] (``HunyuanVideo.forward_orig``'s reshape)."""
    grid = [s // p for s, p in zip(size, patch)]
    out = img.reshape([img.shape[0], *grid, channels, *patch])
    n = len(patch)
    order = [0, n + 1] + [i for d in range(n) for i in (1 + d, n + 2 + d)]
    out = out.permute(order).reshape(img.shape[0], channels, *[g * p for g, p in zip(grid, patch)])
    return out.to(torch.promote_types(out.dtype, torch.float32))


class HunyuanAdapter(ModelAdapter):
    """HunyuanVideo t2v: 16-channel latents of its causal 3D VAE (8x spatial, 4x temporal, so a clip of
    4k + 1 frames gives k + 1 latent frames; an image is a one-frame clip), LLaVA-Llama-3 text + CLIP-L pooled,
    distilled guidance ``guidance`` (as Flux-dev's; 1.0 unless set)."""
    arch = "hunyuan_video"
    dp_aliases = ("hunyuan-video",)
    spec = HV_SPEC
    comfy_config = "HunyuanVideo"            # comfy.supported_models class: its sampling shift is the default
    latent_format = "HunyuanVideo"
    text_fields = ("llama", "pooled")
    sequence_fields = ("llama",)             # text fields that are token sequences (their lengths are carried)
    framerate = HUNYUAN_FPS
    frame_multiple = 4
    vae_scale = 8
    video = True

    @property
    def lora_block_prefixes(self) -> tuple[str, ...]:
        """Every linear of the double and single blocks; without single blocks (HunyuanVideo 1.5) the last
        double block's text outputs reach nothing, so its text projection and MLP are left out."""
        if self.patcher is None or len(self.diffusion_model.single_blocks):
            return ("double_blocks", "single_blocks")
        last = len(self.diffusion_model.double_blocks) - 1
        return (*(f"double_blocks.{i}" for i in range(last)),
                *(f"double_blocks.{last}.{name}" for name in ("img_mod", "img_attn", "img_mlp", "txt_mod",
                                                              "txt_attn.qkv")))

    # --- caching ----------------------------------------------------------------------------------------
    def encode_images(self, vae, pixels):
        """Each image as a one-frame clip (ComfyUI's video VAEs take a batch of images as one clip's frames)."""
        if not self.video:
            return super().encode_images(vae, pixels)
        return torch.cat([self.encode_video(vae, pixels[i:i + 1])[None] for i in range(pixels.shape[0])])

    def encode_video(self, vae, frames):
        if not self.video:
            return super().encode_video(vae, frames)
        import comfy.latent_formats
        fmt = getattr(comfy.latent_formats, self.latent_format)()
        return fmt.process_in(vae.encode(frames).float()).cpu()[0]

    def encode_caption(self, clip, caption):
        out = clip.encode_from_tokens(clip.tokenize(caption), return_pooled=True, return_dict=True)
        return {"llama": _unpadded(out["cond"][0], out.get("attention_mask")),
                "pooled": out["pooled_output"][0].float().cpu()}

    def collate_text(self, items):
        """Zero-padded fields, then each caption's token counts [B, sequences] (the layers mask the padding)."""
        lengths = torch.tensor([[it[name].shape[0] for name in self.sequence_fields] for it in items])
        return [*super().collate_text(items), lengths]

    # --- training ---------------------------------------------------------------------------------------
    def objective(self):
        import comfy.supported_models
        shift = getattr(comfy.supported_models, self.comfy_config).sampling_settings["shift"]
        return self.flow_matching(shift, 1000.0)

    def to_layers(self):
        dm = self.diffusion_model
        layers: list[nn.Module] = [HunyuanInput(dm, self.objective(), self.dtype, self.cfg.guidance)]
        layers += [HunyuanDouble(b, self.dtype) for b in dm.double_blocks]
        layers.append(HunyuanJoin())
        layers += [HunyuanSingle(b, self.dtype) for b in dm.single_blocks]
        layers.append(HunyuanOutput(dm, self.dtype))
        return layers

    # --- checks and sampling ----------------------------------------------------------------------------
    @property
    def channels(self) -> int:
        import comfy.latent_formats
        return getattr(comfy.latent_formats, self.latent_format)().latent_channels

    def empty_latent(self, width, height, frames=1):
        time = (self.latent_frames(frames),) if self.video else ()
        return torch.zeros(1, self.channels, *time, height // self.vae_scale, width // self.vae_scale)

    def probe_latent(self, generator, size=(8, 8)):
        frames = (2,) if self.video else ()
        return torch.randn(1, self.channels, *frames, *size, generator=generator)

    def probe_text(self, generator):
        tokens = 12
        return [torch.randn(1, tokens, self.diffusion_model.params.context_in_dim, generator=generator),
                torch.randn(1, 768, generator=generator), torch.tensor([[tokens]])]

    def reference_forward(self, x_t, t, text):
        """ComfyUI's HunyuanVideo forward, one sample at a time with its unpadded caption."""
        llama, pooled, lengths = text
        dm, timestep = self.diffusion_model, self.objective().model_timestep(t)
        outs = []
        for i in range(x_t.shape[0]):
            guidance = torch.full((1,), self.cfg.guidance, dtype=self.dtype)
            outs.append(dm(x_t[i:i + 1].to(self.dtype), timestep[i:i + 1],
                           llama[i:i + 1, :int(lengths[i, 0])].to(self.dtype), y=pooled[i:i + 1].to(self.dtype),
                           guidance=guidance, transformer_options={}))
        return torch.cat(outs)


def _unpadded(cond: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """One caption's tokens (ComfyUI leaves a mask only where it padded; its padding is dropped)."""
    if mask is not None:
        cond = cond[mask[0].bool().to(cond.device)]
    return cond.float().cpu()


class GlyphAdapter(HunyuanAdapter):
    """What HunyuanVideo 1.5 and HunyuanImage 2.1 share: Qwen2.5-VL-7B text (ComfyUI's template cut off) and
    byT5 glyph tokens for the quoted text of a caption (none when it quotes nothing), no pooled vector."""
    text_fields = ("qwen", "byt5")
    sequence_fields = ("qwen", "byt5")

    def encode_caption(self, clip, caption):
        out = clip.encode_from_tokens(clip.tokenize(caption), return_dict=True)
        glyph = out.get("conditioning_byt5small")
        glyph = torch.zeros(0, GLYPH_WIDTH) if glyph is None else glyph[0].float().cpu()
        return {"qwen": _unpadded(out["cond"][0], out.get("attention_mask")), "byt5": glyph}

    def sample_conditioning(self, text, guidance):
        extra = {"guidance": guidance}
        if text["byt5"].shape[0]:
            extra["conditioning_byt5small"] = text["byt5"][None]
        return [[text["qwen"][None], extra]]

    def probe_text(self, generator):
        tokens, glyphs = 12, 5
        return [torch.randn(1, tokens, self.diffusion_model.params.context_in_dim, generator=generator),
                torch.randn(1, glyphs, GLYPH_WIDTH, generator=generator), torch.tensor([[tokens, glyphs]])]

    def reference_forward(self, x_t, t, text):
        """ComfyUI's forward, one sample at a time with its unpadded caption and glyphs (none: no byT5 input);
        HunyuanVideo 1.5's extra input channels as zeros, as its ``concat_cond`` gives them for t2v."""
        qwen, glyph, lengths = text
        dm, timestep = self.diffusion_model, self.objective().model_timestep(t)
        outs = []
        for i in range(x_t.shape[0]):
            x = x_t[i:i + 1].to(self.dtype)
            extra = dm.img_in.proj.weight.shape[1] - x.shape[1]
            if extra > 0:
                x = torch.cat((x, x.new_zeros(1, extra, *x.shape[2:])), 1)
            n_glyph = int(lengths[i, 1])
            outs.append(dm(x, timestep[i:i + 1], qwen[i:i + 1, :int(lengths[i, 0])].to(self.dtype),
                           txt_byt5=glyph[i:i + 1, :n_glyph].to(self.dtype) if n_glyph else None,
                           disable_time_r=True, transformer_options={}))
        return torch.cat(outs)


class HunyuanVideo15Adapter(GlyphAdapter):
    """HunyuanVideo 1.5 t2v (and t2i as one-frame clips): 32-channel latents of its 16x spatial, 4x temporal
    VAE."""
    arch = "hunyuan_video_15"
    spec = HV15_SPEC
    comfy_config = "HunyuanVideo15"
    latent_format = "HunyuanVideo15"
    vae_scale = 16


class HunyuanImage21Adapter(GlyphAdapter):
    """HunyuanImage 2.1 t2i: 64-channel 2-D latents of its 32x VAE."""
    arch = "hunyuan_image_21"
    dp_aliases = ("hunyuan_image",)
    spec = HI21_SPEC
    comfy_config = "HunyuanImage21"
    latent_format = "HunyuanImage21"
    spatial_multiple = 32
    framerate = None
    frame_multiple = 1
    vae_scale = 32
    video = False
