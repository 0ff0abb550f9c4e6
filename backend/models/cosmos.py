"""NVIDIA Cosmos through ComfyUI: Cosmos-Predict2 text-to-image (2B / 14B, ``comfy.ldm.cosmos.predict2``).

Cosmos-Predict2 works on Wan 2.1 VAE latents; an image is a one-frame clip [B, 16, 1, H, W], as ComfyUI
samples it (``comfy.sample.fix_empty_latent_channels``). ComfyUI's ``predict2.Block`` adds its residuals out
of place, so the layers run ComfyUI's own blocks (attention routed to SDPA); what is re-stated is only
``MiniTrainDIT._forward``'s loop:

    Predict2Input        concat padding mask, x_embedder, RoPE, t_embedder + t_embedding_norm
                                             -> (x, t_emb, adaln_lora, rope, extra_pos, context)
    Predict2Block  xN    blocks[i](x, t_emb, context, rope, adaln_lora)
    Predict2Output       final_layer, unpatchify

Everything but x comes from frozen weights or the data and travels bit-cast to integers.

Objective: ComfyUI samples Cosmos-Predict2 with ``ModelSamplingCosmosRFlow`` (``COSMOS_RFLOW``): for an EDM
sigma it feeds the network (x0 + sigma noise) / (1 + sigma) and the timestep t = sigma / (1 + sigma), and
reads its output as the velocity (denoised = input - t output). With t = sigma / (1 + sigma) that is exactly
rectified flow: x_t = (1 - t) x0 + t noise, target noise - x0, the network taking t itself (multiplier 1).
Training draws t logit-normal (``shift`` / ``flux_shift`` as configured, none by default), as diffusion-pipe
trains it; no loss weighting. The text is the original T5-XXL (v1.0, 1024 wide) as ComfyUI's Cosmos encoder
gives it: 512 tokens with the padding zeroed and NOT masked (ComfyUI passes Cosmos-Predict2 no mask), so the
padding is kept. LoRA goes on every linear of the blocks (self- and cross-attention q/k/v/output, MLP,
the adaLN modulations and their LoRA-style projections).
"""
from __future__ import annotations

import torch
from torch import nn

from .attention import sdpa_transformer_options
from .base import ModelAdapter
from .carry import TupleLayer, hide, reveal, with_grad
from .checkpointing import BlockLayer
from .objectives import FlowMatching
from .spec import ArchSpec, comfy_diffusion_model


def predict2_config(model_channels: int, num_blocks: int, num_heads: int) -> dict:
    """The ``unet_config`` ComfyUI's detection derives from a Cosmos-Predict2 text-to-image checkpoint."""
    return {
        "image_model": "cosmos_predict2", "max_img_h": 240, "max_img_w": 240, "max_frames": 128, "in_channels": 16,
        "out_channels": 16, "patch_spatial": 2, "patch_temporal": 1, "model_channels": model_channels,
        "concat_padding_mask": True, "crossattn_emb_channels": 1024, "pos_emb_cls": "rope3d",
        "pos_emb_learnable": True, "pos_emb_interpolation": "crop", "min_fps": 1, "max_fps": 30,
        "use_adaln_lora": True, "adaln_lora_dim": 256, "num_blocks": num_blocks, "num_heads": num_heads,
        "extra_per_block_abs_pos_emb": False, "rope_h_extrapolation_ratio": 4.0, "rope_w_extrapolation_ratio": 4.0,
        "rope_t_extrapolation_ratio": 1.0, "extra_h_extrapolation_ratio": 1.0, "extra_w_extrapolation_ratio": 1.0,
        "extra_t_extrapolation_ratio": 1.0, "rope_enable_fps_modulation": False,
    }


# full: Cosmos-Predict2 2B t2i (the 14B is model_channels 5120, 36 blocks, 40 heads; ComfyUI detects both).
# tiny: 2 blocks at width 256 (4 heads of 64); ComfyUI pins the depth to the width, so it travels in metadata.
PREDICT2_CONFIGS = {"full": predict2_config(2048, 28, 16), "tiny": predict2_config(256, 2, 4)}


def cosmos_predict2_config(size: str) -> dict:
    return dict(PREDICT2_CONFIGS["full" if size == "full" else "tiny"])


PREDICT2_SPEC = ArchSpec(
    title="Cosmos-Predict2 t2i", comfy_configs=("CosmosT2IPredict2",), unet_config=cosmos_predict2_config,
    build=comfy_diffusion_model("comfy.ldm.cosmos.predict2:MiniTrainDIT"), detected_sizes=("full",),
    text_encoders=("t5xxl_old",), clip_type="COSMOS",
    vae="wan21", example_file="cosmos_predict2_2B_t2i.safetensors")

_NONE = torch.zeros(0)   # stands for an absent tensor (no adaLN-LoRA, no extra position embedding)


def _hide_optional(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    return hide(_NONE.to(dtype) if t is None else t.to(dtype))


def _reveal_optional(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t.numel() == 0 else reveal(t, dtype)


class Predict2Input(TupleLayer):
    cost = 0.05

    def __init__(self, dm, objective, dtype):
        super().__init__()
        # only the embedders become children: the blocks belong to other layers
        self.x_embedder, self.pos_embedder = dm.x_embedder, dm.pos_embedder
        self.extra_pos_embedder = getattr(dm, "extra_pos_embedder", None)
        self.t_embedder, self.t_embedding_norm = dm.t_embedder, dm.t_embedding_norm
        self._prepare = dm.prepare_embedded_sequence
        self.objective, self.dtype = objective, dtype

    def run(self, latents, noise, t, context):
        x_t = self.objective.noisy(latents, noise, t).to(self.dtype)
        x, rope, extra = self._prepare(x_t, fps=None, padding_mask=None)
        timesteps = self.objective.model_timestep(t).reshape(-1, 1)
        t_emb, adaln_lora = self.t_embedder[1](self.t_embedder[0](timesteps).to(x.dtype))
        t_emb = self.t_embedding_norm(t_emb)
        rope = rope.unsqueeze(1).unsqueeze(0)
        return (with_grad(x), hide(t_emb), _hide_optional(adaln_lora, self.dtype), hide(rope.float()),
                _hide_optional(extra, self.dtype), hide(context.to(self.dtype)))


class Predict2Block(BlockLayer):
    def block_forward(self, x, t_emb, adaln_lora, rope, extra, context):
        return self.block(x, reveal(t_emb, self.dtype), reveal(context, self.dtype),
                          rope_emb_L_1_1_D=reveal(rope, torch.float32),
                          adaln_lora_B_T_3D=_reveal_optional(adaln_lora, self.dtype),
                          extra_per_block_pos_emb=_reveal_optional(extra, self.dtype),
                          transformer_options=sdpa_transformer_options())

    def run(self, x, t_emb, adaln_lora, rope, extra, context):
        x = self.checkpointed(x, t_emb, adaln_lora, rope, extra, context)
        return x, t_emb, adaln_lora, rope, extra, context


class Predict2Output(TupleLayer):
    cost = 0.05

    def __init__(self, dm, dtype):
        super().__init__()
        self.final_layer, self.dtype = dm.final_layer, dtype
        self._unpatchify = dm.unpatchify

    def run(self, x, t_emb, adaln_lora, rope, extra, context):
        x = self.final_layer(x, reveal(t_emb, self.dtype), adaln_lora_B_T_3D=_reveal_optional(adaln_lora, self.dtype))
        out = self._unpatchify(x)
        return out.to(torch.promote_types(out.dtype, torch.float32))


class CosmosPredict2Adapter(ModelAdapter):
    arch = "cosmos_predict2"
    spec = PREDICT2_SPEC
    latent_format = "Wan21"
    lora_block_prefixes = ("blocks",)
    text_fields = ("cond",)

    def encode_images(self, vae, pixels):
        """Each image as a one-frame clip: [B, H, W, 3] -> [B, 16, 1, h, w]."""
        import comfy.latent_formats
        fmt = comfy.latent_formats.Wan21()
        return torch.cat([fmt.process_in(vae.encode(pixels[i:i + 1]).float()).cpu() for i in range(pixels.shape[0])])

    def encode_caption(self, clip, caption):
        """T5-XXL's 512 (or more) hidden states, padding zeroed: all of them, since ComfyUI attends to all."""
        out = clip.encode_from_tokens(clip.tokenize(caption), return_dict=True)
        return {"cond": out["cond"][0].float().cpu()}

    def objective(self):
        return FlowMatching.from_model_config(self.cfg, multiplier=1.0)

    def to_layers(self):
        dm = self.diffusion_model
        layers: list[nn.Module] = [Predict2Input(dm, self.objective(), self.dtype)]
        layers += [Predict2Block(b, self.dtype) for b in dm.blocks]
        layers.append(Predict2Output(dm, self.dtype))
        return layers

    def empty_latent(self, width, height):
        return torch.zeros(1, 16, 1, height // 8, width // 8)

    def probe_latent(self, generator, size=(8, 8)):
        return torch.randn(1, 16, 1, *size, generator=generator)

    def probe_text(self, generator):
        cond = torch.randn(1, 16, self.diffusion_model.blocks[0].cross_attn.context_dim, generator=generator)
        cond[:, 12:] = 0   # zeroed padding, as ComfyUI's T5 leaves it
        return [cond]

    def reference_forward(self, x_t, t, text):
        (cond,) = text
        return self.diffusion_model(x_t.to(self.dtype), self.objective().model_timestep(t), cond.to(self.dtype))
