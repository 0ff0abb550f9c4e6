"""SD3 / SD3.5 through ComfyUI's MMDiT (``comfy.ldm.modules.diffusionmodules.mmdit``).

ComfyUI's ``JointBlock`` adds its residuals out of place, so the pipeline layers run ComfyUI's own blocks
(``block_mixing`` with its attention routed to SDPA); what is re-stated is only ``MMDiT.forward``'s loop:

    SD3Input        x = x_embedder(x_t) + pos_embed;  c = t_embedder(1000 t) + y_embedder(pooled);
                    context = context_embedder(cond)                        -> (x, context, c, hw, lengths)
    SD3Block  xN    joint_blocks[i](context, x, c); the last one has no context output -> (x, c, hw, lengths)
    SD3Output       final_layer(x, c), unpatchify, crop

Training is rectified flow as SD3 was trained (target noise - x0, logit-normal t) with ComfyUI's sampling
shift of 3.0 unless ``shift`` is set; the network takes t x 1000, ComfyUI's ``ModelSamplingDiscreteFlow``
multiplier. The text is ComfyUI's SD3 conditioning: CLIP-L and CLIP-G hidden states side by side, padded to
4096 wide, followed by the T5-XXL tokens; the pooled vector is CLIP-L's and CLIP-G's (2048). Captions of
different lengths in one micro-batch are masked (``attention.text_key_mask``).

LoRA goes on every linear of the joint blocks (attention qkv/proj, MLP, adaLN modulation of both
streams; SD3.5's second attention ``attn2`` included).
"""
from __future__ import annotations

import torch
from torch import nn

from .checkpointing import CheckpointedLayer, run_checkpointed
from .attention import sdpa_transformer_options, text_key_mask
from .base import ModelAdapter
from .carry import TupleLayer, hide, reveal, with_grad
from .spec import ArchSpec, comfy_diffusion_model

SD3_SHIFT = 3.0        # ComfyUI's sampling_settings for SD3 (supported_models.SD3)


def mmdit_config(depth: int, pos_embed_max_size: int, context_width: int | None = None, qk_norm: str | None = "rms",
                 x_block_self_attn_layers=()) -> dict:
    """The ``unet_config`` ComfyUI's detection derives from an MMDiT checkpoint (hidden = 64 x depth)."""
    hidden = 64 * depth
    return {
        "in_channels": 16, "patch_size": 2, "out_channels": 16, "depth": depth, "input_size": None,
        "adm_in_channels": 2048,
        "context_embedder_config": {"target": "torch.nn.Linear",
                                    "params": {"in_features": 4096, "out_features": context_width or hidden}},
        "num_patches": pos_embed_max_size ** 2, "pos_embed_max_size": pos_embed_max_size,
        **({"qk_norm": qk_norm} if qk_norm else {}),
        "pos_embed_scaling_factor": None, "x_block_self_attn_layers": list(x_block_self_attn_layers),
    }


# full: SD3.5 Large (8B). tiny: 2 joint blocks at width 128 with SD3.5's RMS q/k norm and, in block 0,
# SD3.5 Medium's second image attention -- still what ComfyUI's detection recognises as SD3.
SD3_CONFIGS = {
    "full": mmdit_config(38, 192),
    "tiny": mmdit_config(2, 32, x_block_self_attn_layers=[0]),
}


def sd3_config(size: str) -> dict:
    return dict(SD3_CONFIGS["full" if size == "full" else "tiny"])


build_mmdit = comfy_diffusion_model("comfy.ldm.modules.diffusionmodules.mmdit:OpenAISignatureMMDITWrapper")




SD3_SPEC = ArchSpec(
    title="SD3 / SD3.5", comfy_configs=("SD3",), unet_config=sd3_config, build=build_mmdit,
    detected_sizes=("tiny", "full"), text_encoders=("clip_l", "clip_g", "t5xxl"), clip_type="SD3",
    vae="kl16", example_file="sd3.5_large.safetensors")


class SD3Input(TupleLayer):
    cost = 0.05

    def __init__(self, dm, objective, dtype):
        super().__init__()
        # only the embedders become children: the blocks belong to other layers
        self.x_embedder, self.t_embedder, self.y_embedder = dm.x_embedder, dm.t_embedder, dm.y_embedder
        self.context_embedder, self.context_processor = dm.context_embedder, dm.context_processor
        self._pos_embed = dm.cropped_pos_embed  # reads dm.pos_embed (a frozen table)
        self.objective, self.dtype = objective, dtype

    def run(self, latents, noise, t, context, pooled, text_lengths):
        import comfy.ops

        x_t = self.objective.noisy(latents, noise, t).to(self.dtype)
        hw = x_t.shape[-2:]
        x = self.x_embedder(x_t) + comfy.ops.cast_to_input(self._pos_embed(hw, device=x_t.device), x_t)
        c = self.t_embedder(self.objective.model_timestep(t), dtype=x.dtype)
        if self.y_embedder is not None:
            c = c + self.y_embedder(pooled.to(self.dtype))
        context = context.to(self.dtype)
        if self.context_processor is not None:
            context = self.context_processor(context)
        context = self.context_embedder(context)
        size = torch.tensor(list(hw), device=x.device)
        return with_grad(x), with_grad(context), hide(c), size, text_lengths


class SD3Block(CheckpointedLayer):
    cost = 1.0

    def __init__(self, block, dtype):
        super().__init__()
        self.block, self.dtype = block, dtype

    def block_forward(self, x, context, c, text_lengths):
        mask = text_key_mask(text_lengths, context.shape[1], x.shape[1])
        return self.block(context, x, c=reveal(c, self.dtype), use_checkpoint=False,
                          transformer_options=sdpa_transformer_options(mask))

    def run(self, x, context, c, hw, text_lengths):
        if self.checkpoint_activations and torch.is_grad_enabled():
            context, x = run_checkpointed(self.checkpoint_activations, self.block_forward, x, context, c,
                                          text_lengths)
        else:
            context, x = self.block_forward(x, context, c, text_lengths)
        if context is None:  # the last block: its context stream only feeds the image stream's attention
            return x, c, hw, text_lengths
        return x, context, c, hw, text_lengths


class SD3Output(TupleLayer):
    cost = 0.05

    def __init__(self, dm, dtype):
        super().__init__()
        self.final_layer, self.dtype = dm.final_layer, dtype
        self._unpatchify = dm.unpatchify

    def run(self, x, c, hw, text_lengths):
        h, w = int(hw[0]), int(hw[1])
        out = self._unpatchify(self.final_layer(x, reveal(c, self.dtype)), hw=(h, w))[:, :, :h, :w]
        return out.to(torch.promote_types(out.dtype, torch.float32))


class SD3Adapter(ModelAdapter):
    dp_diffusers_folder = True
    arch = "sd3"
    spec = SD3_SPEC
    latent_format = "SD3"
    lora_block_prefixes = ("joint_blocks",)
    text_fields = ("cond", "pooled")
    text_lengths = True        # the layers mask the zero padding of the cond tokens

    def encode_caption(self, clip, caption):
        tokens = clip.tokenize(caption)
        out = clip.encode_from_tokens(tokens, return_pooled=True, return_dict=True)
        return {"cond": out["cond"][0].float().cpu(), "pooled": out["pooled_output"][0].float().cpu()}

    def objective(self):
        return self.flow_matching(SD3_SHIFT, 1000.0)

    def to_layers(self):
        dm = self.diffusion_model
        layers: list[nn.Module] = [SD3Input(dm, self.objective(), self.dtype)]
        layers += [SD3Block(b, self.dtype) for b in dm.joint_blocks]
        layers.append(SD3Output(dm, self.dtype))
        return layers

    def probe_text(self, generator):
        dm = self.diffusion_model
        tokens = 16
        return [torch.randn(1, tokens, dm.context_embedder.in_features, generator=generator),
                torch.randn(1, dm.y_embedder.mlp[0].in_features, generator=generator), torch.tensor([tokens])]

    def reference_forward(self, x_t, t, text):
        """ComfyUI's MMDiT forward, one sample at a time when the captions differ in length (as ComfyUI
        runs conditionings it cannot concatenate)."""
        cond, pooled, lengths = text
        dm, timestep = self.diffusion_model, self.objective().model_timestep(t)
        outs = []
        for i in range(x_t.shape[0]):
            outs.append(dm(x_t[i:i + 1].to(self.dtype), timestep[i:i + 1],
                           context=cond[i:i + 1, :int(lengths[i])].to(self.dtype), y=pooled[i:i + 1].to(self.dtype)))
        return torch.cat(outs)
