"""Chroma through ComfyUI's ``comfy.ldm.chroma`` model: Flux's double and single blocks without per-block
modulation layers; one "distilled guidance" network (``Approximator``) computes every block's shift, scale
and gate from the timestep at once.

The layers call ComfyUI's modules and re-state the block maths out of place (``flux.double_block`` /
``flux.single_block``, which Flux uses too: ComfyUI adds the residuals in place):

    ChromaInput        img_in(patches), txt_in(T5), the approximator's modulation table, RoPE
    ChromaDouble  xN   double_blocks[i] with its rows of the table   (img, txt, mods, pe, hw, lengths)
    JoinStreams        cat(txt, img)
    ChromaSingle  xM   single_blocks[i]                              (x, mods, pe, hw, lengths)
    ChromaOutput       final_layer with the table's last two rows, unpatchify

The modulation table and RoPE come from frozen weights and travel bit-cast to integers. Training is
rectified flow (target noise - x0; ``shift`` / ``flux_shift`` as configured), the network takes t as ComfyUI's
``ModelSamplingFlux`` gives it, and the distilled-guidance input is 0 as ComfyUI samples Chroma. The text is
T5-XXL alone, unpadded as ComfyUI's PixArt tokenizer leaves it; captions of different lengths in one
micro-batch are masked. LoRA goes on every linear of the double and single blocks.
"""
from __future__ import annotations

import torch
from einops import rearrange, repeat
from torch import nn

from .attention import text_key_mask
from .base import ModelAdapter
from .carry import TupleLayer, hide, reveal, sizes, with_grad
from .checkpointing import CheckpointedLayer
from .flux import FluxOutput, JoinStreams, double_block, image_tokens, single_block, unpatchify
from .objectives import FlowMatching
from .spec import ArchSpec, comfy_diffusion_model

GUIDANCE = 0.0               # model_base.Chroma's default distilled guidance
MOD_INDEX_LENGTH = 344       # rows of the modulation table (comfy.ldm.chroma.model, fixed)

# Chroma as ComfyUI detects it (model_detection pins the width, heads, axes and the approximator).
CHROMA_FULL = {
    "image_model": "chroma", "in_channels": 64, "out_channels": 64, "context_in_dim": 4096, "hidden_size": 3072,
    "mlp_ratio": 4.0, "num_heads": 24, "depth": 19, "depth_single_blocks": 38, "axes_dim": [16, 56, 56],
    "theta": 10000, "patch_size": 2, "qkv_bias": True, "in_dim": 64, "out_dim": 3072, "hidden_dim": 5120,
    "n_layers": 5,
}
# Chroma's structure at width 256 (4 heads of 64), 2 + 2 blocks, a 2-layer approximator: ComfyUI cannot
# detect the width, so tiny files carry this config in their metadata.
CHROMA_TINY = {**CHROMA_FULL, "hidden_size": 256, "num_heads": 4, "axes_dim": [16, 24, 24], "depth": 2,
               "depth_single_blocks": 2, "out_dim": 256, "hidden_dim": 256, "n_layers": 2}


def chroma_config(size: str) -> dict:
    return dict(CHROMA_FULL if size == "full" else CHROMA_TINY)


build_chroma = comfy_diffusion_model("comfy.ldm.chroma.model:Chroma")




CHROMA_SPEC = ArchSpec(
    title="Chroma", comfy_configs=("Chroma",), unet_config=chroma_config, build=build_chroma,
    detected_sizes=("full",), text_encoders=("t5xxl",), clip_type="CHROMA", vae="kl16",
    example_file="chroma-unlocked-v50.safetensors", text_encoder_types=("chroma", "pixart"))


class ChromaInput(TupleLayer):
    cost = 0.05

    def __init__(self, dm, objective, dtype):
        super().__init__()
        # only the input modules become children: the blocks belong to other layers
        self.img_in, self.txt_in, self.pe_embedder = dm.img_in, dm.txt_in, dm.pe_embedder
        self.distilled_guidance_layer = dm.distilled_guidance_layer
        self.patch_size, self.objective, self.dtype = dm.patch_size, objective, dtype

    def modulations(self, t, like):
        """``Chroma.forward_orig``'s modulation table [B, 344, hidden] for timesteps ``t``."""
        from comfy.ldm.flux.layers import timestep_embedding

        b = t.shape[0]
        distill_timestep = timestep_embedding(t, 16).to(like)
        distil_guidance = timestep_embedding(torch.full_like(t, GUIDANCE), 16).to(like)
        index = timestep_embedding(torch.arange(MOD_INDEX_LENGTH, device=t.device), 32).to(like)
        index = index.unsqueeze(0).repeat(b, 1, 1)
        guidance = torch.cat([distill_timestep, distil_guidance], dim=1).unsqueeze(1).repeat(1, MOD_INDEX_LENGTH, 1)
        return self.distilled_guidance_layer(torch.cat([guidance, index], dim=-1))

    def run(self, latents, noise, t, context, text_lengths):
        import comfy.ldm.common_dit

        x = self.objective.noisy(latents, noise, t).to(self.dtype)
        b, _, h, w = x.shape
        ps = self.patch_size
        img = rearrange(comfy.ldm.common_dit.pad_to_patch_size(x, (ps, ps)),
                        "b c (h ph) (w pw) -> b (h w) (c ph pw)", ph=ps, pw=ps)
        h_len, w_len = (h + ps // 2) // ps, (w + ps // 2) // ps
        img_ids = torch.zeros((h_len, w_len, 3), device=x.device, dtype=x.dtype)
        img_ids[:, :, 1] += torch.linspace(0, h_len - 1, steps=h_len, device=x.device, dtype=x.dtype).unsqueeze(1)
        img_ids[:, :, 2] += torch.linspace(0, w_len - 1, steps=w_len, device=x.device, dtype=x.dtype).unsqueeze(0)
        img_ids = repeat(img_ids, "h w c -> b (h w) c", b=b)
        txt_ids = torch.zeros((b, context.shape[1], 3), device=x.device, dtype=x.dtype)
        pe = self.pe_embedder(torch.cat((txt_ids, img_ids), dim=1))
        mods = self.modulations(self.objective.model_timestep(t), img)
        img = self.img_in(img)
        txt = self.txt_in(context.to(self.dtype))
        hw = sizes(h, w)
        return with_grad(img), with_grad(txt), hide(mods), hide(pe.float()), hw, text_lengths


class ChromaDouble(CheckpointedLayer):
    cost = 1.0

    def __init__(self, block, index: int, get_modulations, dtype):
        super().__init__()
        self.block, self.index, self.dtype = block, index, dtype
        self._get_modulations = get_modulations  # Chroma.get_modulations (no weights)

    def block_forward(self, img, txt, mods, pe, hw, text_lengths):
        table = reveal(mods, self.dtype)
        img_mod1, img_mod2 = self._get_modulations(table, "double_img", idx=self.index)
        txt_mod1, txt_mod2 = self._get_modulations(table, "double_txt", idx=self.index)
        mask = text_key_mask(text_lengths, txt.shape[1], img.shape[1])
        img, txt = double_block(self.block, img, txt, (img_mod1, img_mod2, txt_mod1, txt_mod2),
                                reveal(pe, torch.float32), mask)
        return img, txt, mods, pe, hw, text_lengths


class ChromaJoin(JoinStreams):
    def run(self, img, txt, mods, pe, hw, text_lengths):
        return torch.cat((txt, img), 1), mods, pe, hw, text_lengths


class ChromaSingle(CheckpointedLayer):
    cost = 1.0

    def __init__(self, block, index: int, get_modulations, patch_size: int, dtype):
        super().__init__()
        self.block, self.index, self.patch_size, self.dtype = block, index, patch_size, dtype
        self._get_modulations = get_modulations

    def block_forward(self, x, mods, pe, hw, text_lengths):
        mod = self._get_modulations(reveal(mods, self.dtype), "single", idx=self.index)
        ps = self.patch_size
        img_tokens = ((int(hw[0]) + ps // 2) // ps) * ((int(hw[1]) + ps // 2) // ps)
        mask = text_key_mask(text_lengths, x.shape[1] - img_tokens, img_tokens)
        return single_block(self.block, x, mod, reveal(pe, torch.float32), mask), mods, pe, hw, text_lengths


class ChromaOutput(FluxOutput):
    def __init__(self, dm, dtype):
        super().__init__(dm, dtype)
        self._get_modulations = dm.get_modulations

    def run(self, x, mods, pe, hw, text_lengths):
        img, grid = image_tokens(x, hw, self.patch_size)
        out = self.final_layer(img, vec=self._get_modulations(reveal(mods, self.dtype), "final"))
        return unpatchify(out, grid, self.patch_size)


class ChromaAdapter(ModelAdapter):
    dp_folder_borrows = ("t5xxl",)
    dp_transformer_example = "chroma-unlocked-v50.safetensors"
    dp_fuse_adapters = True
    arch = "chroma"
    spec = CHROMA_SPEC
    latent_format = "Flux"
    lora_block_prefixes = ("double_blocks", "single_blocks")
    text_fields = ("t5",)
    text_lengths = True        # the layers mask the zero padding of T5 tokens

    def encode_caption(self, clip, caption):
        tokens = clip.tokenize(caption)
        out = clip.encode_from_tokens(tokens, return_dict=True)
        return {"t5": out["cond"][0].float().cpu()}

    def objective(self):
        return FlowMatching.from_model_config(self.cfg)

    def to_layers(self):
        dm = self.diffusion_model
        layers: list[nn.Module] = [ChromaInput(dm, self.objective(), self.dtype)]
        layers += [ChromaDouble(b, i, dm.get_modulations, self.dtype)
                   for i, b in enumerate(dm.double_blocks)]
        layers.append(ChromaJoin())
        layers += [ChromaSingle(b, i, dm.get_modulations, dm.patch_size, self.dtype)
                   for i, b in enumerate(dm.single_blocks)]
        layers.append(ChromaOutput(dm, self.dtype))
        return layers

    def sample_conditioning(self, text, guidance):
        # no pooled vector (as ComfyUI's T5 encode gives); no guidance: ComfyUI's Chroma default (0), as trained
        return [[text["t5"][None], {"pooled_output": None}]]

    def probe_text(self, generator):
        tokens = 12
        return [torch.randn(1, tokens, self.diffusion_model.params.context_in_dim, generator=generator),
                torch.tensor([tokens])]

    def reference_forward(self, x_t, t, text):
        """ComfyUI's Chroma forward, one sample at a time with its unpadded caption."""
        t5, lengths = text
        dm, timestep = self.diffusion_model, self.objective().model_timestep(t)
        outs = []
        for i in range(x_t.shape[0]):
            outs.append(dm(x_t[i:i + 1].to(self.dtype), timestep[i:i + 1], t5[i:i + 1, :int(lengths[i])].to(self.dtype),
                           torch.full((1,), GUIDANCE, dtype=self.dtype)))
        return torch.cat(outs)
