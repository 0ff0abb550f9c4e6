# SPDX-License-Identifier: GPL-3.0-or-later
"""Flux 2 dev through ComfyUI's ``comfy.ldm.flux`` model with Flux 2's parameters (``image_model: flux2``).

Flux 2 is Flux's double/single-block transformer at width 6144 (48 heads of 128; 8 double, 48 single blocks)
with 128-channel latents (its VAE's 32 channels of an 8x KL latent with each 2 x 2 patch folded into channels
and batch-normalised: 16x in all) taken one token per latent pixel; no pooled text vector; bias-free linears and
SwiGLU MLPs; a 4-axis RoPE whose last axis numbers the text tokens; and no modulation layers in the blocks:
three shared layers compute the shift / scale / gate of every double block and every single block from the
timestep + guidance vector at once. The text is Mistral-Small-3.1-24B's hidden states at layers 10, 20 and 30
side by side (3 x 5120 wide), which ComfyUI left-pads with zeros to 512 tokens before the model sees them
(``model_base.Flux2.extra_conds``); the batches here are padded the same way.

The layers call ComfyUI's modules and re-state the block maths out of place (``flux.double_block`` /
``flux.single_block``; ComfyUI adds the residuals in place):

    Flux2Input       img_in(latent tokens), txt_in(text), time + guidance vector, the shared modulations, RoPE
    Flux2Double xN   double_blocks[i] with the shared double-block modulations        (img, txt, mods, pe, hw)
    JoinStreams      cat(txt, img)
    Flux2Single xM   single_blocks[i] with the shared single-block modulation         (x, mods, pe, hw)
    Flux2Output      final_layer with the vector, unpatchify

``mods`` is one frozen table [B, 1, 16 x width]: the three modulation layers' outputs (6 + 6 + 3 chunks) and the
vector the final layer takes; it and RoPE travel bit-cast to integers. Training is rectified flow (target
noise - x0) on t as ComfyUI's ``ModelSamplingFlux`` feeds it, with a constant shift of 3 unless the [model]
table sets ``shift`` (diffusion-pipe's suggestion for Flux-2-VAE models); ``guidance`` is the distilled guidance
input (1.0 by default, as diffusion-pipe trains Flux 2). LoRA goes on every linear of the double and single
blocks (attention qkv / proj and both MLP linears of each stream; linear1 / linear2).
"""
from __future__ import annotations

import torch
from torch import nn

from .base import ModelAdapter
from .carry import TupleLayer, hide, reveal, sizes, with_grad
from .checkpointing import CheckpointedLayer
from .flux import FluxOutput, JoinStreams, build_flux, double_block, image_tokens, single_block, unpatchify
from .objectives import FlowMatching
from .spec import ArchSpec

TEXT_TOKENS = 512            # model_base.Flux2 left-pads the text to this many tokens
DEFAULT_SHIFT = 3.0
MOD_CHUNKS = 16              # 6 double-img + 6 double-txt + 3 single modulation chunks + the final layer's vector

# Flux 2 dev as ComfyUI's detection gives it (comfy/model_detection.py fixes everything but widths and depths).
FLUX2_DEV = {
    "image_model": "flux2", "in_channels": 128, "out_channels": 128, "vec_in_dim": None, "context_in_dim": 15360,
    "hidden_size": 6144, "mlp_ratio": 3.0, "num_heads": 48, "depth": 8, "depth_single_blocks": 48,
    "axes_dim": [32, 32, 32, 32], "theta": 2000, "patch_size": 1, "qkv_bias": False, "guidance_embed": True,
    "global_modulation": True, "mlp_silu_act": True, "ops_bias": False, "default_ref_method": "index",
    "ref_index_scale": 10.0,
}
# Flux 2's structure at width 256 (4 heads of 64), 2 + 2 blocks, taking the tiny Mistral's 3 x 64 wide text.
# ComfyUI pins 48 heads of 128, so tiny files carry this config in their metadata.
FLUX2_TINY = {**FLUX2_DEV, "hidden_size": 256, "num_heads": 4, "axes_dim": [16, 16, 16, 16], "context_in_dim": 192,
              "depth": 2, "depth_single_blocks": 2}


def flux2_config(size: str) -> dict:
    return dict(FLUX2_DEV if size == "full" else FLUX2_TINY)


# ComfyUI builds every Flux 2 (dev, Klein) from its Flux2 class; the text width tells them apart: Mistral's 3 x 5120
# for dev, Qwen3-4B's 3 x 2560 and Qwen3-8B's 3 x 4096 for Klein 4B and 9B (``flux2_klein.py``)
KLEIN_TEXT_WIDTHS = (7680, 12288)


def reads_mistral(unet_config: dict) -> bool:
    """Whether a Flux 2 file ComfyUI detected is Flux 2 dev (the Mistral text) rather than a Klein."""
    return unet_config.get("context_in_dim") not in KLEIN_TEXT_WIDTHS


FLUX2_SPEC = ArchSpec(
    title="Flux 2 dev", comfy_configs=("Flux2",), unet_config=flux2_config, build=build_flux,
    detected_sizes=("full",), text_encoders=("mistral3_24b",), accepts=reads_mistral,
    # ComfyUI's CLIPLoader "flux2" type has no CLIPType in 0.3.75 and falls back to this one; the Mistral
    # weights themselves select Flux 2's text encoder
    clip_type="STABLE_DIFFUSION", vae="flux2", text_encoder_types=("flux2",),
    example_file="flux2-dev.safetensors")


def text_ids(context: torch.Tensor, axes: int) -> torch.Tensor:
    """Flux 2's text positions: zeros but for the last axis, which numbers the tokens."""
    b, n = context.shape[:2]
    ids = torch.zeros(b, n, axes, device=context.device, dtype=torch.float32)
    ids[:, :, -1] = torch.linspace(0, n - 1, steps=n, device=context.device, dtype=torch.float32)
    return ids


def _chunks(*mods) -> list[torch.Tensor]:
    return [c for pair in mods for m in pair if m is not None for c in (m.shift, m.scale, m.gate)]


def _modulations(table: torch.Tensor):
    """The table's double-block (img_mod1, img_mod2, txt_mod1, txt_mod2), single-block mod and final vector."""
    from comfy.ldm.flux.layers import ModulationOut

    c = table.chunk(MOD_CHUNKS, dim=-1)
    double = tuple(ModulationOut(*c[i:i + 3]) for i in (0, 3, 6, 9))
    return double, ModulationOut(*c[12:15]), c[15]


class Flux2Input(TupleLayer):
    cost = 0.05

    def __init__(self, dm, objective, dtype, guidance: float):
        super().__init__()
        # only the input modules become children: the blocks belong to other layers
        self.img_in, self.time_in, self.txt_in, self.pe_embedder = dm.img_in, dm.time_in, dm.txt_in, dm.pe_embedder
        self.guidance_in = dm.guidance_in
        self.double_stream_modulation_img = dm.double_stream_modulation_img
        self.double_stream_modulation_txt = dm.double_stream_modulation_txt
        self.single_stream_modulation = dm.single_stream_modulation
        self._process_img = dm.process_img
        self.params = dm.params
        self.objective, self.dtype, self.guidance = objective, dtype, guidance

    def run(self, latents, noise, t, context):
        x = self.objective.noisy(latents, noise, t).to(self.dtype)
        img, img_ids = self._process_img(x)
        return self.embed(x, img, img_ids, t, context)

    def embed(self, x, img, img_ids, t, context):
        """The first stage's outputs for the noisy latent ``x`` as image tokens ``img`` at positions ``img_ids``
        (Flux 2 edit appends its reference images' tokens to both)."""
        from comfy.ldm.flux.layers import timestep_embedding

        dtype = self.dtype
        pe = self.pe_embedder(torch.cat((text_ids(context, img_ids.shape[-1]), img_ids), dim=1))
        img = self.img_in(img)
        vec = self.time_in(timestep_embedding(self.objective.model_timestep(t), 256).to(dtype))
        if self.params.guidance_embed:
            vec = vec + self.guidance_in(timestep_embedding(torch.full_like(t, self.guidance), 256).to(dtype))
        txt = self.txt_in(context.to(dtype))
        mods = torch.cat(_chunks(self.double_stream_modulation_img(vec), self.double_stream_modulation_txt(vec),
                                 self.single_stream_modulation(vec)) + [vec[:, None]], dim=-1)
        hw = sizes(x.shape[-2], x.shape[-1])
        return with_grad(img), with_grad(txt), hide(mods), hide(pe.float()), hw


class Flux2Double(CheckpointedLayer):
    cost = 2.0   # two streams of a single block's width each: twice a single block's linears

    def __init__(self, block, dtype):
        super().__init__()
        self.block, self.dtype = block, dtype

    def block_forward(self, img, txt, mods, pe, hw):
        double, _, _ = _modulations(reveal(mods, self.dtype))
        img, txt = double_block(self.block, img, txt, double, reveal(pe, torch.float32))
        return img, txt, mods, pe, hw


class Flux2Single(CheckpointedLayer):
    cost = 1.0

    def __init__(self, block, dtype):
        super().__init__()
        self.block, self.dtype = block, dtype

    def block_forward(self, x, mods, pe, hw):
        _, mod, _ = _modulations(reveal(mods, self.dtype))
        return single_block(self.block, x, mod, reveal(pe, torch.float32)), mods, pe, hw


class Flux2Output(FluxOutput):
    def run(self, x, mods, pe, hw):
        img, grid = image_tokens(x, hw, self.patch_size)
        _, _, vec = _modulations(reveal(mods, self.dtype))
        return unpatchify(self.final_layer(img, vec), grid, self.patch_size)


class Flux2Adapter(ModelAdapter):
    arch = "flux2"
    spec = FLUX2_SPEC
    latent_format = "Flux2"
    lora_block_prefixes = ("double_blocks", "single_blocks")
    text_fields = ("mistral",)

    def encode_caption(self, clip, caption):
        tokens = clip.tokenize(caption)
        return {self.text_fields[0]: clip.encode_from_tokens(tokens, return_dict=True)["cond"][0].float().cpu()}

    def collate_text(self, items):
        """Each caption left-padded with zeros to 512 tokens (or to the longest, if longer), as ComfyUI pads
        Flux 2's text; the padding takes part in attention there too."""
        ts = [it[self.text_fields[0]] for it in items]
        n = max([TEXT_TOKENS] + [t.shape[0] for t in ts])
        return [torch.stack([torch.nn.functional.pad(t, (0, 0, n - t.shape[0], 0)) for t in ts])]

    def objective(self):
        return FlowMatching.from_model_config(self.cfg, default_shift=DEFAULT_SHIFT)

    def seq_len(self, latent):
        return latent.shape[-1] * latent.shape[-2]   # one token per latent pixel

    def to_layers(self):
        dm = self.diffusion_model
        layers: list[nn.Module] = [Flux2Input(dm, self.objective(), self.dtype, self.cfg.guidance)]
        layers += [Flux2Double(b, self.dtype) for b in dm.double_blocks]
        layers.append(JoinStreams())
        layers += [Flux2Single(b, self.dtype) for b in dm.single_blocks]
        layers.append(Flux2Output(dm, self.dtype))
        return layers

    def sample_conditioning(self, text, guidance):
        """No pooled vector: ComfyUI's Flux 2 text encoding gives ``pooled_output`` None, and ``model_base.Flux``
        reads the key (without it sampling fails)."""
        return [[text[self.text_fields[0]][None], {"guidance": guidance, "pooled_output": None}]]

    def empty_latent(self, width, height):
        return torch.zeros(1, 128, height // 16, width // 16)

    def probe_text(self, generator):
        caption = torch.randn(16, self.diffusion_model.params.context_in_dim, generator=generator)
        return self.collate_text([{self.text_fields[0]: caption}])

    def reference_forward(self, x_t, t, text):
        (context,) = text
        dm = self.diffusion_model
        guidance = torch.full_like(t, self.cfg.guidance) if dm.params.guidance_embed else None
        return dm(x_t.to(self.dtype), t, context.to(self.dtype), guidance=guidance)
