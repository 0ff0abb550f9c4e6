"""AuraFlow (v0.1 - v0.3, Pony v7's base) through ComfyUI's ``comfy.ldm.aura.mmdit.MMDiT``.

ComfyUI's ``MMDiTBlock`` and ``DiTBlock`` add their residuals out of place, so the layers run ComfyUI's own
blocks (attention routed to SDPA); what is re-stated is only ``MMDiT._forward``'s loop:

    AuraInput          init_x_linear(patches) + position table; 8 register tokens + cond_seq_linear(text);
                       t_embedder(t)                                  -> (x, c, global_cond, hw, lengths)
    AuraDouble   xN    double_layers[i](c, x, global_cond)
    AuraJoin           cat(c, x)
    AuraSingle   xM    single_layers[i](cx, global_cond)              -> (cx, global_cond, hw, lengths)
    AuraOutput         modF / final_linear on the image tokens, unpatchify, crop

Training is rectified flow (target noise - x0) with ComfyUI's AuraFlow sampling settings: the network takes
t itself (multiplier 1; its timestep embedding scales by 1000 inside) and t is shifted by 1.73 unless
``shift`` is set. The text is Pile-T5-XL's, as ComfyUI encodes it: at least 256 tokens with the padding
zeroed (a caption alone always gives ComfyUI's own sequence). Captions longer than 256 tokens make the
micro-batch's sequences differ in length; the zero padding PipeTrain adds then is masked out as keys, so
each sample trains as it would alone. LoRA goes on every linear of the double and single layers
(attention q/k/v/o of both streams, SwiGLU MLPs, adaLN modulations).
"""
from __future__ import annotations

import torch
from torch import nn

from .attention import sdpa_transformer_options, text_key_mask
from .base import ModelAdapter
from .carry import TupleLayer, hide, reveal, sizes, with_grad
from .checkpointing import BlockLayer
from .spec import ArchSpec, comfy_diffusion_model
from .token_lengths import fit_tokens

AURA_SHIFT = 1.73          # ComfyUI's sampling_settings for AuraFlow (supported_models.AuraFlow)
AURA_MULTIPLIER = 1.0
REGISTER_TOKENS = 8        # MMDiT.register_tokens, prepended to the text
PILE_T5_PAD = 1            # ComfyUI's PT5XlTokenizer pad token (its encoder zeroes what it pads)


def aura_config(max_seq: int, cond_seq_dim: int, n_double_layers: int, n_layers: int, **width) -> dict:
    """The ``unet_config`` ComfyUI's detection derives from an AuraFlow checkpoint (the width, heads and
    patch size are MMDiT's defaults there: 3072, 12 heads of 256, 2); ``width`` overrides those."""
    return {"max_seq": max_seq, "cond_seq_dim": cond_seq_dim, "n_double_layers": n_double_layers,
            "n_layers": n_layers, **width}


# full: AuraFlow v0.3 (4 double + 32 single layers, a 96 x 96 position table for up to 1536 px).
# tiny: 1 double + 1 single layer at width 256 (4 heads of 64) taking the tiny Pile-T5 (256 wide): ComfyUI
# cannot see the width, so tiny files carry this config in their metadata.
AURA_CONFIGS = {
    "full": aura_config(9216, 2048, 4, 36),
    "tiny": aura_config(1024, 256, 1, 2, dim=256, n_heads=4, global_conddim=256),
}


def auraflow_config(size: str) -> dict:
    return dict(AURA_CONFIGS["full" if size == "full" else "tiny"])


AURA_SPEC = ArchSpec(
    title="AuraFlow", comfy_configs=("AuraFlow",), unet_config=auraflow_config,
    build=comfy_diffusion_model("comfy.ldm.aura.mmdit:MMDiT"),
    detected_sizes=("full",), text_encoders=("pile_t5xl",), clip_type="STABLE_DIFFUSION",
    vae="kl4", example_file="aura_flow_0.3.safetensors", text_encoder_types=("auraflow", "stable_diffusion"))


def _key_mask(text_lengths, c_len: int, x_len: int):
    """Keys of [register tokens, text, image]: the zero padding after each caption hidden."""
    return text_key_mask(text_lengths + REGISTER_TOKENS, c_len, x_len)


class AuraInput(TupleLayer):
    cost = 0.05

    def __init__(self, dm, objective, dtype):
        super().__init__()
        # only the embedders become children: the blocks belong to other layers
        self.init_x_linear, self.cond_seq_linear, self.t_embedder = dm.init_x_linear, dm.cond_seq_linear, dm.t_embedder
        # the frozen tables are shared with ComfyUI's model, whose patchify / position code reads them
        self.register_tokens, self.positional_encoding = dm.register_tokens, dm.positional_encoding
        self._patchify, self._apply_pos_embeds = dm.patchify, dm.apply_pos_embeds
        self.objective, self.dtype = objective, dtype

    def run(self, latents, noise, t, context, text_lengths):
        import comfy.ops

        x_t = self.objective.noisy(latents, noise, t).to(self.dtype)
        h, w = x_t.shape[-2:]
        x = self._apply_pos_embeds(self.init_x_linear(self._patchify(x_t)), h, w)
        c = self.cond_seq_linear(context.to(self.dtype))
        c = torch.cat([comfy.ops.cast_to_input(self.register_tokens, c).repeat(c.shape[0], 1, 1), c], dim=1)
        global_cond = self.t_embedder(self.objective.model_timestep(t), x.dtype)
        hw = sizes(h, w)
        return with_grad(x), with_grad(c), hide(global_cond), hw, text_lengths


class AuraDouble(BlockLayer):
    def block_forward(self, x, c, global_cond, hw, text_lengths):
        options = sdpa_transformer_options(_key_mask(text_lengths, c.shape[1], x.shape[1]))
        c, x = self.block(c, x, reveal(global_cond, self.dtype), transformer_options=options)
        return x, c, global_cond, hw, text_lengths


class AuraJoin(TupleLayer):
    cost = 0.0

    def run(self, x, c, global_cond, hw, text_lengths):
        return torch.cat([c, x], dim=1), global_cond, hw, text_lengths


def _image_tokens(hw, patch_size: int) -> int:
    return ((int(hw[0]) + 1) // patch_size) * ((int(hw[1]) + 1) // patch_size)


class AuraSingle(BlockLayer):
    def __init__(self, block, patch_size: int, dtype):
        super().__init__(block, dtype)
        self.patch_size = patch_size

    def block_forward(self, cx, global_cond, hw, text_lengths):
        x_len = _image_tokens(hw, self.patch_size)
        options = sdpa_transformer_options(_key_mask(text_lengths, cx.shape[1] - x_len, x_len))
        cx = self.block(cx, reveal(global_cond, self.dtype), transformer_options=options)
        return cx, global_cond, hw, text_lengths


class AuraOutput(TupleLayer):
    cost = 0.05

    def __init__(self, dm, dtype):
        super().__init__()
        self.modF, self.final_linear = dm.modF, dm.final_linear
        self._unpatchify = dm.unpatchify
        self.patch_size, self.dtype = dm.patch_size, dtype

    def run(self, cx, global_cond, hw, text_lengths):
        from comfy.ldm.aura.mmdit import modulate

        h, w = int(hw[0]), int(hw[1])
        x = cx[:, cx.shape[1] - _image_tokens(hw, self.patch_size):]
        shift, scale = self.modF(reveal(global_cond, self.dtype)).chunk(2, dim=1)
        x = self.final_linear(modulate(x, shift, scale))
        p = self.patch_size
        out = self._unpatchify(x, (h + 1) // p, (w + 1) // p)[:, :, :h, :w]
        return out.to(torch.promote_types(out.dtype, torch.float32))


class AuraFlowAdapter(ModelAdapter):
    arch = "auraflow"
    spec = AURA_SPEC
    dp_token_length_key = "max_sequence_length"
    latent_format = "SDXL"
    lora_block_prefixes = ("double_layers", "single_layers")
    text_fields = ("cond",)
    text_lengths = True        # the layers mask the zero padding of Pile-T5 tokens

    def encode_caption(self, clip, caption):
        tokens = clip.tokenize(caption)
        if self.cfg.max_sequence_length is not None:   # diffusion-pipe's: cut and padded to this many
            tokens["pile_t5xl"] = [fit_tokens(tokens["pile_t5xl"][0], self.cfg.max_sequence_length, PILE_T5_PAD,
                                              keep_last=True)]
        out = clip.encode_from_tokens(tokens, return_dict=True)
        return {"cond": out["cond"][0].float().cpu()}

    def text_options(self):
        length = self.cfg.max_sequence_length
        return {} if length is None else {"max_sequence_length": length}

    def objective(self):
        return self.flow_matching(AURA_SHIFT, AURA_MULTIPLIER)

    def to_layers(self):
        dm = self.diffusion_model
        layers: list[nn.Module] = [AuraInput(dm, self.objective(), self.dtype)]
        layers += [AuraDouble(b, self.dtype) for b in dm.double_layers]
        layers.append(AuraJoin())
        layers += [AuraSingle(b, dm.patch_size, self.dtype) for b in dm.single_layers]
        layers.append(AuraOutput(dm, self.dtype))
        return layers

    def sample_conditioning(self, text, guidance):
        return [[text["cond"][None], {}]]

    def probe_text(self, generator):
        tokens = 16
        return [torch.randn(1, tokens, self.diffusion_model.cond_seq_linear.in_features, generator=generator),
                torch.tensor([tokens])]

    def reference_forward(self, x_t, t, text):
        """ComfyUI's MMDiT forward, one sample at a time with its own (unpadded) caption."""
        cond, lengths = text
        dm, timestep = self.diffusion_model, self.objective().model_timestep(t)
        outs = [dm(x_t[i:i + 1].to(self.dtype), timestep[i:i + 1], cond[i:i + 1, :int(lengths[i])].to(self.dtype))
                for i in range(x_t.shape[0])]
        return torch.cat(outs)
