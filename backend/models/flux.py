"""Flux (dev / schnell) through ComfyUI's ``comfy.ldm.flux`` model.

ComfyUI's block forwards add residuals in place (``img += ...``), which autograd rejects, so the
pipeline layers below re-state the block maths out of place while calling ComfyUI's own submodules
(and therefore its weights, LoRA targets and key names). ``tests/unit/test_flux_layers.py`` checks them
against ComfyUI's forward.
"""
from __future__ import annotations

import torch
from einops import rearrange

from .attention import rope_attention
from .base import ModelAdapter
from .carry import TupleLayer, hide, reveal, sizes, with_grad
from .checkpointing import CheckpointedLayer
from .objectives import FlowMatching
from .spec import ArchSpec, comfy_diffusion_model

# Flux-dev as ComfyUI detects it (comfy/model_detection.py fixes heads, axes and widths).
FLUX_DEV = {
    "in_channels": 16, "out_channels": 16, "vec_in_dim": 768, "context_in_dim": 4096,
    "hidden_size": 3072, "mlp_ratio": 4.0, "num_heads": 24, "axes_dim": [16, 56, 56], "theta": 10000,
    "patch_size": 2, "qkv_bias": True, "guidance_embed": True,
}
FLUX_DEPTHS = {"micro": (2, 2), "tiny": (1, 1), "full": (19, 38)}  # (double blocks, single blocks)
# "micro": Flux's structure at width 256 (4 heads of 64) for fast multi-step CPU tests; ComfyUI cannot
# detect that width, so its config travels in the file's metadata like the tiny SDXL UNet's.
FLUX_MICRO_WIDTH = {"hidden_size": 256, "num_heads": 4, "axes_dim": [16, 24, 24]}


def flux_config(size: str) -> dict:
    depth, single = FLUX_DEPTHS[size]
    width = FLUX_MICRO_WIDTH if size == "micro" else {}
    return {**FLUX_DEV, **width, "depth": depth, "depth_single_blocks": single}


def build_flux(config: dict | str) -> torch.nn.Module:
    """ComfyUI's Flux on the meta device, from a config or a size name."""
    config = flux_config(config) if isinstance(config, str) else config
    return comfy_diffusion_model("comfy.ldm.flux.model:Flux")(config)




FLUX_SPEC = ArchSpec(
    title="Flux", comfy_configs=("Flux", "FluxSchnell"), unet_config=flux_config, build=build_flux,
    detected_sizes=("tiny", "full"), text_encoders=("clip_l", "t5xxl"), clip_type="FLUX",
    vae="kl16", example_file="flux1-dev.safetensors")


class FluxInput(TupleLayer):
    cost = 0.05

    def __init__(self, dm, objective, dtype, guidance: float):
        super().__init__()
        # only the input modules become children: the rest of the model belongs to other layers
        self.img_in, self.time_in, self.txt_in, self.pe_embedder = dm.img_in, dm.time_in, dm.txt_in, dm.pe_embedder
        self.vector_in, self.guidance_in = dm.vector_in, dm.guidance_in
        self._process_img = dm.process_img
        self.params = dm.params
        self.objective, self.dtype, self.guidance = objective, dtype, guidance

    def run(self, latents, noise, t, context, pooled):
        x = self.objective.noisy(latents, noise, t).to(self.dtype)
        img, img_ids = self._process_img(x)
        return self.embed(x, img, img_ids, t, context, pooled)

    def embed(self, x, img, img_ids, t, context, pooled):
        """The first stage's outputs for the noisy latent ``x`` as image tokens ``img`` at positions ``img_ids``
        (Flux Kontext appends its reference image's tokens to both)."""
        from comfy.ldm.flux.layers import timestep_embedding

        dtype = self.dtype
        txt_ids = torch.zeros(x.shape[0], context.shape[1], img_ids.shape[-1], device=x.device, dtype=img_ids.dtype)
        pe = self.pe_embedder(torch.cat((txt_ids, img_ids), dim=1))
        img = self.img_in(img)
        vec = self.time_in(timestep_embedding(self.objective.model_timestep(t), 256).to(dtype))
        if self.params.guidance_embed:
            g = torch.full_like(t, self.guidance)
            vec = vec + self.guidance_in(timestep_embedding(g, 256).to(dtype))
        vec = vec + self.vector_in(pooled.to(dtype)[:, :self.params.vec_in_dim])
        txt = self.txt_in(context.to(dtype))
        hw = sizes(x.shape[-2], x.shape[-1])
        return with_grad(img), with_grad(txt), hide(vec), hide(pe.float()), hw


def _modulate(x, mod):
    return (1 + mod.scale) * x + mod.shift


def _heads(qkv, num_heads):
    b, n, _ = qkv.shape
    return qkv.view(b, n, 3, num_heads, -1).permute(2, 0, 3, 1, 4)


def double_block(blk, img, txt, mods, pe, mask=None):
    """ComfyUI's ``DoubleStreamBlock.forward`` out of place: ``mods`` = (img_mod1, img_mod2, txt_mod1,
    txt_mod2), ``mask`` an optional key mask over [txt, img] (``attention.text_key_mask``)."""
    img_mod1, img_mod2, txt_mod1, txt_mod2 = mods
    img_q, img_k, img_v = _heads(blk.img_attn.qkv(_modulate(blk.img_norm1(img), img_mod1)), blk.num_heads)
    img_q, img_k = blk.img_attn.norm(img_q, img_k, img_v)
    txt_q, txt_k, txt_v = _heads(blk.txt_attn.qkv(_modulate(blk.txt_norm1(txt), txt_mod1)), blk.num_heads)
    txt_q, txt_k = blk.txt_attn.norm(txt_q, txt_k, txt_v)
    attn = rope_attention(torch.cat((txt_q, img_q), 2), torch.cat((txt_k, img_k), 2),
                          torch.cat((txt_v, img_v), 2), pe, mask)
    txt_attn, img_attn = attn[:, :txt.shape[1]], attn[:, txt.shape[1]:]
    img = img + img_mod1.gate * blk.img_attn.proj(img_attn)
    img = img + img_mod2.gate * blk.img_mlp(_modulate(blk.img_norm2(img), img_mod2))
    txt = txt + txt_mod1.gate * blk.txt_attn.proj(txt_attn)
    txt = txt + txt_mod2.gate * blk.txt_mlp(_modulate(blk.txt_norm2(txt), txt_mod2))
    return img, txt


def _mlp_width(blk) -> int:
    """The MLP's share of ``linear1``'s output: ``mlp_hidden_dim_first`` (twice the MLP width for Flux 2's gated
    SiLU) where ComfyUI has it (0.3.6x on), the MLP width before."""
    return getattr(blk, "mlp_hidden_dim_first", blk.mlp_hidden_dim)


def single_block(blk, x, mod, pe, mask=None):
    """ComfyUI's ``SingleStreamBlock.forward`` out of place, with the block's modulation ``mod``."""
    qkv, mlp = torch.split(blk.linear1(_modulate(blk.pre_norm(x), mod)),
                           [3 * blk.hidden_size, _mlp_width(blk)], dim=-1)
    q, k, v = _heads(qkv, blk.num_heads)
    q, k = blk.norm(q, k, v)
    attn = rope_attention(q, k, v, pe, mask)
    return x + mod.gate * blk.linear2(torch.cat((attn, blk.mlp_act(mlp)), 2))


class DoubleBlock(CheckpointedLayer):
    cost = 1.0

    def __init__(self, block, dtype):
        super().__init__()
        self.block, self.dtype = block, dtype

    def block_forward(self, img, txt, vec, pe, hw):
        blk = self.block
        v = reveal(vec, self.dtype)
        mods = (*blk.img_mod(v), *blk.txt_mod(v))
        img, txt = double_block(blk, img, txt, mods, reveal(pe, torch.float32))
        return img, txt, vec, pe, hw


class JoinStreams(TupleLayer):
    cost = 0.0

    def run(self, img, txt, vec, pe, hw):
        return torch.cat((txt, img), 1), vec, pe, hw


class SingleBlock(CheckpointedLayer):
    cost = 1.0

    def __init__(self, block, dtype):
        super().__init__()
        self.block, self.dtype = block, dtype

    def block_forward(self, x, vec, pe, hw):
        mod, _ = self.block.modulation(reveal(vec, self.dtype))
        return single_block(self.block, x, mod, reveal(pe, torch.float32)), vec, pe, hw


class FluxOutput(TupleLayer):
    cost = 0.05

    def __init__(self, dm, dtype):
        super().__init__()
        self.final_layer, self.patch_size, self.dtype = dm.final_layer, dm.patch_size, dtype

    def run(self, x, vec, pe, hw):
        img, grid = image_tokens(x, hw, self.patch_size)
        return unpatchify(self.final_layer(img, reveal(vec, self.dtype)), grid, self.patch_size)


def image_tokens(x: torch.Tensor, hw: torch.Tensor, patch_size: int):
    """The image tokens at the end of a joint (text, image) sequence, and the latent grid they cover.
    ``hw`` is the latent's [h, w], or [h, w, n] where n more tokens follow the image's (Kontext's reference)."""
    h, w = int(hw[0]), int(hw[1])
    end = x.shape[1] - (int(hw[2]) if hw.numel() > 2 else 0)
    h_len, w_len = (h + patch_size // 2) // patch_size, (w + patch_size // 2) // patch_size
    return x[:, end - h_len * w_len:end], (h, w, h_len, w_len)


def unpatchify(out: torch.Tensor, grid, patch_size: int) -> torch.Tensor:
    h, w, h_len, w_len = grid
    out = rearrange(out, "b (h w) (c ph pw) -> b c (h ph) (w pw)", h=h_len, w=w_len, ph=patch_size, pw=patch_size)
    return out[:, :, :h, :w].to(torch.promote_types(out.dtype, torch.float32))


class FluxAdapter(ModelAdapter):
    dp_diffusers_folder = True
    arch = "flux"
    spec = FLUX_SPEC
    dp_diffusers_lora = True
    dp_fuse_adapters = True
    latent_format = "Flux"
    lora_block_prefixes = ("double_blocks", "single_blocks")
    text_fields = ("t5", "pooled")
    input_layer = FluxInput

    def encode_caption(self, clip, caption):
        tokens = clip.tokenize(caption)
        out = clip.encode_from_tokens(tokens, return_pooled=True, return_dict=True)
        return {"t5": out["cond"][0].float().cpu(), "pooled": out["pooled_output"][0].float().cpu()}

    def objective(self):
        return FlowMatching.from_model_config(self.cfg)

    def to_layers(self):
        dm = self.diffusion_model
        layers = [self.input_layer(dm, self.objective(), self.dtype, self.cfg.guidance)]
        layers += [DoubleBlock(b, self.dtype) for b in dm.double_blocks]
        layers.append(JoinStreams())
        layers += [SingleBlock(b, self.dtype) for b in dm.single_blocks]
        layers.append(FluxOutput(dm, self.dtype))
        return layers

    def probe_text(self, generator):
        dm = self.diffusion_model
        return [torch.randn(1, 16, dm.params.context_in_dim, generator=generator),
                torch.randn(1, dm.params.vec_in_dim, generator=generator)]

    def reference_forward(self, x_t, t, text):
        context, pooled = text
        dm = self.diffusion_model
        guidance = torch.full_like(t, self.cfg.guidance) if dm.params.guidance_embed else None
        return dm(x_t.to(self.dtype), t, context.to(self.dtype), y=pooled.to(self.dtype), guidance=guidance)


# --- diffusion-pipe's Flux LoRA saves (init_from_existing) ---------------------------------------------------------
DIFFUSERS_LORA_PREFIX = "transformer."   # Diffusers' save_lora_weights names the transformer's tensors so


def is_diffusers_lora(sd: dict) -> bool:
    """A Diffusers-named Flux LoRA: what diffusion-pipe saves for its Diffusers-based Flux
    (``transformer.transformer_blocks.N.attn.to_q.lora_A.weight`` ...)."""
    return any(k.startswith(DIFFUSERS_LORA_PREFIX) and k.endswith(".lora_A.weight") and "transformer_blocks." in k
               for k in sd)


def diffusers_lora_parts(sd: dict, dm) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A Diffusers-named Flux LoRA (its update ``B @ A`` at scale 1: diffusion-pipe saves alpha = rank) on ComfyUI's
    modules: {ComfyUI module path: (A, B)}. Where ComfyUI fuses several Diffusers linears into one (a double block's
    q, k and v into ``qkv``; a single block's q, k, v and MLP input into ``linear1``), A stacks the parts' A rows and
    B puts each part's B at its output rows (ComfyUI's own ``flux_to_diffusers`` offsets), zero elsewhere: ``B @ A``
    is each part's update at its rows, exactly, with the parts' ranks added up. ``ValueError`` names a tensor no
    ComfyUI module takes."""
    import comfy.utils

    params = dm.params
    key_map = comfy.utils.flux_to_diffusers({"depth": params.depth, "depth_single_blocks": params.depth_single_blocks,
                                             "hidden_size": params.hidden_size})
    parts: dict[str, list] = {}
    for key in sorted(k for k in sd if k.endswith(".lora_A.weight")):
        module = key[len(DIFFUSERS_LORA_PREFIX):-len(".lora_A.weight")]
        target = key_map.get(f"{module}.weight")
        if target is None or f"{DIFFUSERS_LORA_PREFIX}{module}.lora_B.weight" not in sd:
            raise ValueError(f"{key}: no Flux module of ComfyUI's takes it (or its lora_B is missing)")
        name, offset = (target, 0) if isinstance(target, str) else (target[0], target[1][1])
        parts.setdefault(name[:-len(".weight")], []).append(
            (offset, sd[key], sd[f"{DIFFUSERS_LORA_PREFIX}{module}.lora_B.weight"]))
    out = {}
    for name, pieces in parts.items():
        rows = dm.get_submodule(name).weight.shape[0]
        a = torch.cat([p[1] for p in pieces])
        b = torch.zeros(rows, a.shape[0], dtype=pieces[0][2].dtype)
        col = 0
        for offset, part_a, part_b in pieces:
            b[offset:offset + part_b.shape[0], col:col + part_a.shape[0]] = part_b
            col += part_a.shape[0]
        out[name] = (a, b)
    return out
