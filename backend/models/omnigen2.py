"""OmniGen2 text-to-image through ComfyUI's ``comfy.ldm.omnigen.omnigen2.OmniGen2Transformer2DModel``.

ComfyUI's ``OmniGen2TransformerBlock`` adds its residuals out of place, so the layers run ComfyUI's own blocks
(attention routed to SDPA); what is re-stated is ``OmniGen2Transformer2DModel.forward``'s loop, text-to-image
only (no reference images, so ``ref_image_refiner`` and ``ref_image_patch_embedder`` stay unused):

    OmniInput                  time_caption_embed(1 - t, Qwen tokens); x_embedder(patches); RoPE of
                               [text, image] from ComfyUI's rope_embedder -> (img, text, temb, rope, hw, lengths)
    OmniContextRefiner   xR    context_refiner[i](text)     (no modulation)
    OmniNoiseRefiner     xR    noise_refiner[i](img, temb)
    OmniJoin                   cat(text, img)
    OmniBlock            xN    layers[i](x, temb)
    OmniOutput                 norm_out, the image tokens, unpatchify, negate (ComfyUI's sign), crop

Training is rectified flow (target noise - x0) with ComfyUI's OmniGen2 sampling settings: the network takes
t itself (multiplier 1; it embeds 1 - t scaled by 1000 inside) and t is shifted by 2.6 unless ``shift`` is set.
The text is Qwen2.5-VL-3B's last hidden state over ComfyUI's chat template, unpadded; captions of different
lengths in one micro-batch are zero-padded, each sample's image positions start after its own caption (as
ComfyUI's rope embedder places them) and the padding is masked out as keys, so each sample trains as it would
alone. LoRA goes on every linear of the transformer blocks and of the context and noise refiners (attention
q/k/v/out, SwiGLU feed-forward, the modulation linear).
"""
from __future__ import annotations

import torch
from einops import rearrange
from torch import nn

from .attention import sdpa_transformer_options, text_key_mask
from .base import ModelAdapter
from .carry import TupleLayer, hide, reveal, sizes, with_grad
from .checkpointing import BlockLayer
from .spec import ArchSpec, comfy_diffusion_model

OMNIGEN2_SHIFT = 2.6          # ComfyUI's sampling_settings for OmniGen2 (supported_models.Omnigen2)
OMNIGEN2_MULTIPLIER = 1.0

# OmniGen2 as ComfyUI's detection gives it (model_detection pins every value).
OMNIGEN2_FULL = {
    "image_model": "omnigen2", "axes_dim_rope": [40, 40, 40], "axes_lens": [1024, 1664, 1664],
    "ffn_dim_multiplier": None, "hidden_size": 2520, "in_channels": 16, "multiple_of": 256, "norm_eps": 1e-05,
    "num_attention_heads": 21, "num_kv_heads": 7, "num_layers": 32, "num_refiner_layers": 2, "out_channels": None,
    "patch_size": 2, "text_feat_dim": 2048, "timestep_scale": 1000.0,
}
# OmniGen2's structure at width 64 (2 query heads of 32 sharing 1 key/value head), 1 refiner layer per stream,
# 2 blocks, taking the tiny Qwen2.5-3B (64 wide): ComfyUI pins the size, so tiny files carry this config.
OMNIGEN2_TINY = {**OMNIGEN2_FULL, "axes_dim_rope": [8, 12, 12], "hidden_size": 64, "num_attention_heads": 2,
                 "num_kv_heads": 1, "num_layers": 2, "num_refiner_layers": 1, "text_feat_dim": 64}


def omnigen2_config(size: str) -> dict:
    return dict(OMNIGEN2_FULL if size == "full" else OMNIGEN2_TINY)


OMNIGEN2_SPEC = ArchSpec(
    title="OmniGen2", comfy_configs=("Omnigen2",), unet_config=omnigen2_config,
    build=comfy_diffusion_model("comfy.ldm.omnigen.omnigen2:OmniGen2Transformer2DModel"),
    detected_sizes=("full",), text_encoders=("qwen25_3b",), clip_type="OMNIGEN2",
    vae="kl16", example_file="omnigen2_fp16.safetensors")


class OmniInput(TupleLayer):
    cost = 0.05

    def __init__(self, dm, objective, dtype):
        super().__init__()
        # only the embedders become children: the blocks belong to other layers
        self.x_embedder, self.time_caption_embed = dm.x_embedder, dm.time_caption_embed
        self.rope_embedder = dm.rope_embedder
        self.patch_size, self.objective, self.dtype = dm.patch_size, objective, dtype

    def run(self, latents, noise, t, context, text_lengths):
        import comfy.ldm.common_dit

        x = self.objective.noisy(latents, noise, t).to(self.dtype)
        b, _, h, w = x.shape
        p = self.patch_size
        x = comfy.ldm.common_dit.pad_to_patch_size(x, (p, p))
        hp, wp = x.shape[-2:]
        temb, text = self.time_caption_embed(1.0 - self.objective.model_timestep(t), context.to(self.dtype), x.dtype)
        img = self.x_embedder(rearrange(x, "b c (h p1) (w p2) -> b (h w) (p1 p2 c)", p1=p, p2=p))
        img_len = img.shape[1]
        # per sample: caption positions 0 .. n - 1, image positions after its own caption (zeros on the padding)
        cap_rope, _, img_rope, *_ = self.rope_embedder(
            b, text.shape[1], [int(n) for n in text_lengths], [[0]] * b, [img_len] * b, [None] * b,
            [(hp, wp)] * b, x.device)
        rope = torch.cat([cap_rope, img_rope], dim=1)
        size = sizes(h, w)
        return with_grad(img), with_grad(text), hide(temb), hide(rope.float()), size, text_lengths


class OmniContextRefiner(BlockLayer):
    cost = 0.3

    def block_forward(self, img, text, temb, rope, size, text_lengths):
        mask = text_key_mask(text_lengths, text.shape[1], 0)
        text = self.block(text, mask, reveal(rope, torch.float32)[:, :text.shape[1]],
                          transformer_options=sdpa_transformer_options())
        return img, text, temb, rope, size, text_lengths


class OmniNoiseRefiner(BlockLayer):
    cost = 0.7

    def block_forward(self, img, text, temb, rope, size, text_lengths):
        img = self.block(img, None, reveal(rope, torch.float32)[:, text.shape[1]:], reveal(temb, self.dtype),
                         transformer_options=sdpa_transformer_options())
        return img, text, temb, rope, size, text_lengths


class OmniJoin(TupleLayer):
    cost = 0.0

    def run(self, img, text, temb, rope, size, text_lengths):
        return torch.cat([text, img], dim=1), temb, rope, size, text_lengths


def _grid(size, patch_size: int) -> tuple[int, int]:
    return (int(size[0]) + patch_size - 1) // patch_size, (int(size[1]) + patch_size - 1) // patch_size


class OmniBlock(BlockLayer):
    def __init__(self, block, patch_size: int, dtype):
        super().__init__(block, dtype)
        self.patch_size = patch_size

    def block_forward(self, x, temb, rope, size, text_lengths):
        hp, wp = _grid(size, self.patch_size)
        mask = text_key_mask(text_lengths, x.shape[1] - hp * wp, hp * wp)
        x = self.block(x, mask, reveal(rope, torch.float32), reveal(temb, self.dtype),
                       transformer_options=sdpa_transformer_options())
        return x, temb, rope, size, text_lengths


class OmniOutput(TupleLayer):
    cost = 0.05

    def __init__(self, dm, dtype):
        super().__init__()
        self.norm_out, self.patch_size, self.dtype = dm.norm_out, dm.patch_size, dtype

    def run(self, x, temb, rope, size, text_lengths):
        h, w = int(size[0]), int(size[1])
        p = self.patch_size
        hp, wp = _grid(size, p)
        out = self.norm_out(x[:, x.shape[1] - hp * wp:], reveal(temb, self.dtype))
        out = rearrange(out, "b (h w) (p1 p2 c) -> b c (h p1) (w p2)", h=hp, w=wp, p1=p, p2=p)[:, :, :h, :w]
        out = -out
        return out.to(torch.promote_types(out.dtype, torch.float32))


class OmniGen2Adapter(ModelAdapter):
    arch = "omnigen2"
    spec = OMNIGEN2_SPEC
    # OmniGen2's Diffusers folder (the only way diffusion-pipe reads it): its transformer's module names are
    # ComfyUI's port's own, its vae/ is the Flux VAE in Diffusers' layout (ComfyUI converts it) and its mllm/ a
    # Hugging Face Qwen2.5-VL-3B (renamed to ComfyUI's keys, ``model_folders.qwen_vl_state_dict``)
    dp_diffusers_folder = True
    dp_folder_pipeline = "OmniGen2"
    latent_format = "Flux"
    lora_block_prefixes = ("context_refiner", "noise_refiner", "layers")
    text_fields = ("cond",)
    text_lengths = True        # the layers mask the zero padding of Qwen tokens

    def encode_caption(self, clip, caption):
        tokens = clip.tokenize(caption)
        out = clip.encode_from_tokens(tokens, return_dict=True)
        mask = out.get("attention_mask")
        cond = out["cond"][0]
        if mask is not None:   # ComfyUI's Qwen tokenizer does not pad one caption; keep its tokens only
            cond = cond[:max(1, int(mask.sum()))]
        return {"cond": cond.float().cpu()}

    def objective(self):
        return self.flow_matching(OMNIGEN2_SHIFT, OMNIGEN2_MULTIPLIER)

    def to_layers(self):
        dm = self.diffusion_model
        layers: list[nn.Module] = [OmniInput(dm, self.objective(), self.dtype)]
        layers += [OmniContextRefiner(b, self.dtype) for b in dm.context_refiner]
        layers += [OmniNoiseRefiner(b, self.dtype) for b in dm.noise_refiner]
        layers.append(OmniJoin())
        layers += [OmniBlock(b, dm.patch_size, self.dtype) for b in dm.layers]
        layers.append(OmniOutput(dm, self.dtype))
        return layers

    def sample_conditioning(self, text, guidance):
        cond = text["cond"][None]
        return [[cond, {"attention_mask": torch.ones(cond.shape[:2], dtype=torch.long)}]]

    def probe_text(self, generator):
        tokens = 12
        width = self.diffusion_model.time_caption_embed.caption_embedder[1].in_features
        return [torch.randn(1, tokens, width, generator=generator), torch.tensor([tokens])]

    def reference_forward(self, x_t, t, text):
        """ComfyUI's OmniGen2 forward, one sample at a time with its own (unpadded) caption."""
        cond, lengths = text
        dm, timestep = self.diffusion_model, self.objective().model_timestep(t)
        outs = []
        for i in range(x_t.shape[0]):
            n = int(lengths[i])
            outs.append(dm(x_t[i:i + 1].to(self.dtype), timestep[i:i + 1], cond[i:i + 1, :n].to(self.dtype), n))
        return torch.cat(outs)
