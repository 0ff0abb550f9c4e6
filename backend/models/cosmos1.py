"""NVIDIA Cosmos 1.0 text-to-video (Cosmos-1.0-Diffusion 7B / 14B Text2World) through ComfyUI's
``comfy.ldm.cosmos.model.GeneralDIT`` (``comfy.supported_models.CosmosT2V``).

Latents are 5-D [B, 16, T, H, W] from Cosmos' causal continuous video tokenizer CV8x8x8
(``comfy.ldm.cosmos.vae``: 8x spatial, 8x temporal with a causal first frame, so a clip of 8k + 1 frames gives
k + 1 latent frames); a still image is a one-frame clip. Clips are resampled to Cosmos' 24 fps (the rotary
embedding's base rate, so ComfyUI's fps-less sampling sees the same positions).

GeneralDIT's blocks work on [T, H, W, B, D] tokens and add their residuals out of place; what ComfyUI does in
place is ``x += extra_pos_emb`` before every block, re-stated here out of place. The layers:

    Cosmos1Input        padding-mask channel, x_embedder, RoPE table, learnable extra position embedding,
                        t_embedder + affline_norm, tokens to [T, H, W, B, D], context to [M, B, D]
    Cosmos1Block  xN    x + extra_pos_emb, then blocks[i] (self-attention, cross-attention, MLP)
    Cosmos1Output       decoder_head (final_layer, unpatchify)

Everything but x comes from frozen weights or the data and travels bit-cast to integers.

Objective: ComfyUI samples Cosmos 1 with EDM (``ModelType.EDM``, sigma_data 0.5): the network takes
c_in x = x / sqrt(sigma^2 + 0.25) at timestep 0.25 log sigma and its output F gives the denoised latent
c_skip x + c_out F. Training is EDM's: the denoiser's squared error against x0 weighted by
(sigma^2 + sigma_data^2) / (sigma sigma_data)^2, which is exactly the MSE of F against
F* = (sigma x0 - sigma_data^2 noise) / (sigma_data sqrt(sigma^2 + sigma_data^2)), with log sigma ~ N(0, 1) as
diffusion-pipe and the Cosmos authors train it (P_mean 0, P_std 1). The objective draws a flow time t and
uses sigma = t / (1 - t), so the ``[model]`` keys keep their meaning: logit-normal t with ``sigmoid_scale``
s is log sigma ~ N(0, s) (the default s = 1 is P_std 1), and ``shift`` m multiplies sigma by m
(P_mean = log m). The text is the original T5-XXL (v1.0, 1024 wide): 512 tokens with the padding zeroed and
not masked (ComfyUI's GeneralDIT ignores the mask). LoRA goes on every linear of the blocks (q/k/v/output of
the self- and cross-attention, the 2 MLP linears, and the adaLN modulation of each of the 3 sub-blocks).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .attention import sdpa_transformer_options
from .base import ModelAdapter, VideoLatents
from .carry import TupleLayer, hide, reveal, with_grad
from .checkpointing import BlockLayer
from .objectives import FlowMatching
from .spec import ArchSpec, comfy_diffusion_model

COSMOS1_FPS = 24
SIGMA_DATA = 0.5


def cosmos1_config(model_channels: int, num_blocks: int, num_heads: int, rope: tuple[float, float, float],
                   extra: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> dict:
    """The ``unet_config`` ComfyUI's detection derives from a Cosmos 1.0 Text2World checkpoint; ``rope`` and
    ``extra``: the (h, w, t) extrapolation ratios of the rotary and the extra position embeddings."""
    config = {
        "image_model": "cosmos", "max_img_h": 240, "max_img_w": 240, "max_frames": 128, "in_channels": 16,
        "out_channels": 16, "patch_spatial": 2, "patch_temporal": 1, "model_channels": model_channels,
        "block_config": "FA-CA-MLP", "concat_padding_mask": True, "pos_emb_cls": "rope3d",
        "pos_emb_learnable": False, "pos_emb_interpolation": "crop", "block_x_format": "THWBD",
        "affline_emb_norm": True, "use_adaln_lora": True, "adaln_lora_dim": 256, "num_blocks": num_blocks,
        "num_heads": num_heads, "extra_per_block_abs_pos_emb": True, "rope_h_extrapolation_ratio": rope[0],
        "rope_w_extrapolation_ratio": rope[1], "rope_t_extrapolation_ratio": rope[2],
        "extra_per_block_abs_pos_emb_type": "learnable",
    }
    if extra != (1.0, 1.0, 1.0):   # ComfyUI names them only for the 14B
        config.update({"extra_h_extrapolation_ratio": extra[0], "extra_w_extrapolation_ratio": extra[1],
                       "extra_t_extrapolation_ratio": extra[2]})
    return config


# full: Cosmos-1.0-Diffusion-7B-Text2World (full_14b: the 14B; ComfyUI detects both). tiny: 2 blocks at width
# 256 (4 heads of 64); ComfyUI takes any width but 4096 for the 14B, so its config travels in metadata.
COSMOS1_CONFIGS = {
    "full": cosmos1_config(4096, 28, 32, rope=(1.0, 1.0, 2.0)),
    "full_14b": cosmos1_config(5120, 36, 40, rope=(2.0, 2.0, 2.0), extra=(2.0, 2.0, 2.0)),
    "tiny": cosmos1_config(256, 2, 4, rope=(1.0, 1.0, 2.0)),
}


def cosmos1_unet_config(size: str) -> dict:
    return dict(COSMOS1_CONFIGS["full" if size == "full" else "tiny"])


COSMOS1_SPEC = ArchSpec(
    title="Cosmos 1.0 t2v", comfy_configs=("CosmosT2V",), unet_config=cosmos1_unet_config,
    build=comfy_diffusion_model("comfy.ldm.cosmos.model:GeneralDIT"), detected_sizes=("full",),
    text_encoders=("t5xxl_old",), clip_type="COSMOS",
    vae="cosmos1_cv8x8x8", example_file="Cosmos-1_0-Diffusion-7B-Text2World.safetensors")


def _per_sample(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return v.reshape(-1, *([1] * (like.ndim - 1))).to(like.dtype)


@dataclass
class EDMObjective(FlowMatching):
    """EDM training (Karras et al.) in ComfyUI's ``EDM`` parametrisation, indexed by a flow time t drawn as
    ``FlowMatching`` draws it: sigma = t / (1 - t). ``noisy`` is the network's input c_in (x0 + sigma noise),
    ``model_timestep`` its c_noise = 0.25 log sigma, ``target`` the output F for which c_skip x + c_out F = x0;
    the plain MSE on F is EDM's loss-weighted denoiser error."""
    sigma_data: float = SIGMA_DATA

    @staticmethod
    def sigma(t: torch.Tensor) -> torch.Tensor:
        t = t.clamp(1e-6, 1 - 1e-6)
        return t / (1 - t)

    def noisy(self, x0, noise, t):
        s = _per_sample(self.sigma(t), x0)
        return (x0 + s * noise) / (s ** 2 + self.sigma_data ** 2).sqrt()

    def model_timestep(self, t):
        return 0.25 * self.sigma(t).log()

    def target(self, x0, noise, t):
        s, sd = _per_sample(self.sigma(t), x0), self.sigma_data
        return (s * x0 - sd ** 2 * noise) / (sd * (s ** 2 + sd ** 2).sqrt())


_NONE = torch.zeros(0)   # stands for an absent tensor


def _thwbd(x: torch.Tensor) -> torch.Tensor:
    """[B, T, H, W, D] -> [T, H, W, B, D], GeneralDIT's block layout."""
    return x.permute(1, 2, 3, 0, 4).contiguous()


class Cosmos1Input(TupleLayer):
    cost = 0.05

    def __init__(self, dm, objective, dtype):
        super().__init__()
        # only the embedders become children: the blocks belong to other layers
        self.x_embedder, self.pos_embedder = dm.x_embedder, dm.pos_embedder
        self.extra_pos_embedder = getattr(dm, "extra_pos_embedder", None)
        self.t_embedder, self.affline_norm = dm.t_embedder, dm.affline_norm
        self._prepare = dm.prepare_embedded_sequence
        self.objective, self.dtype = objective, dtype

    def run(self, latents, noise, t, context):
        x_in = self.objective.noisy(latents, noise, t).to(self.dtype)
        x, rope, extra = self._prepare(x_in, fps=None, padding_mask=None)
        timesteps = self.objective.model_timestep(t).flatten()
        t_emb, adaln_lora = self.t_embedder[1](self.t_embedder[0](timesteps).to(x.dtype))
        t_emb = self.affline_norm(t_emb)
        extra = _NONE.to(self.dtype) if extra is None else _thwbd(extra.to(self.dtype))
        context = context.to(self.dtype).transpose(0, 1).contiguous()   # [M, B, D]
        return (with_grad(_thwbd(x)), hide(t_emb), hide(adaln_lora), hide(rope.float()), hide(extra),
                hide(context))


class Cosmos1Block(BlockLayer):
    def block_forward(self, x, t_emb, adaln_lora, rope, extra, context):
        extra = reveal(extra, self.dtype)
        if extra.numel():
            x = x + extra   # ComfyUI: x += extra_pos_emb before every block
        return self.block(x, reveal(t_emb, self.dtype), reveal(context, self.dtype), None,
                          rope_emb_L_1_1_D=reveal(rope, torch.float32),
                          adaln_lora_B_3D=reveal(adaln_lora, self.dtype),
                          transformer_options=sdpa_transformer_options())

    def run(self, x, t_emb, adaln_lora, rope, extra, context):
        x = self.checkpointed(x, t_emb, adaln_lora, rope, extra, context)
        return x.contiguous(), t_emb, adaln_lora, rope, extra, context


class Cosmos1Output(TupleLayer):
    cost = 0.05

    def __init__(self, dm, dtype):
        super().__init__()
        self.final_layer, self.dtype = dm.final_layer, dtype
        self._decoder_head = dm.decoder_head
        self.patch_spatial, self.patch_temporal, self.channels = dm.patch_spatial, dm.patch_temporal, dm.in_channels

    def run(self, x, t_emb, adaln_lora, rope, extra, context):
        t, h, w, b, _ = x.shape
        shape = (b, self.channels, t * self.patch_temporal, h * self.patch_spatial, w * self.patch_spatial)
        out = self._decoder_head(x.permute(3, 0, 1, 2, 4), reveal(t_emb, self.dtype), None, shape,
                                 adaln_lora_B_3D=reveal(adaln_lora, self.dtype))
        return out.to(torch.promote_types(out.dtype, torch.float32))


class Cosmos1Adapter(VideoLatents, ModelAdapter):
    arch = "cosmos"
    spec = COSMOS1_SPEC
    latent_format = "Cosmos1CV8x8x8"
    lora_block_prefixes = ("blocks",)
    samples_first = False   # GeneralDIT's blocks hold the tokens as (T, H, W, B, D): the samples come last
    text_fields = ("cond",)
    framerate = COSMOS1_FPS
    frame_multiple = 8          # clips of 8k + 1 frames (the tokenizer's causal 8x temporal compression)
    # the parity check (backend/parity/check.py) runs in float32: ComfyUI normalises the positional embeddings in
    # float32, which torch refuses for float64 input
    parity_dtype = torch.float32

    def encode_caption(self, clip, caption):
        """T5-XXL's 512 (or more) hidden states, padding zeroed: all of them, since ComfyUI attends to all."""
        out = clip.encode_from_tokens(clip.tokenize(caption), return_dict=True)
        return {"cond": out["cond"][0].float().cpu()}

    def objective(self):
        return EDMObjective(sample_method=self.cfg.timestep_sample_method, sigmoid_scale=self.cfg.sigmoid_scale,
                            shift=self.cfg.shift, flux_shift=self.cfg.flux_shift, min_t=self.cfg.min_t,
                            max_t=self.cfg.max_t)

    def to_layers(self):
        dm = self.diffusion_model
        layers: list[nn.Module] = [Cosmos1Input(dm, self.objective(), self.dtype)]
        layers += [Cosmos1Block(b, self.dtype) for b in dm.blocks.values()]
        layers.append(Cosmos1Output(dm, self.dtype))
        return layers

    def empty_latent(self, width, height, frames=1):
        return torch.zeros(1, 16, self.latent_frames(frames), height // 8, width // 8)

    def probe_latent(self, generator, size=(8, 8)):
        return torch.randn(1, 16, 2, *size, generator=generator)

    def probe_text(self, generator):
        width = self.diffusion_model.blocks["block0"].blocks[1].block.attn.to_k[0].in_features
        cond = torch.randn(1, 16, width, generator=generator)
        cond[:, 12:] = 0   # zeroed padding, as ComfyUI's T5 leaves it
        return [cond]

    def reference_forward(self, x_t, t, text):
        (cond,) = text
        return self.diffusion_model(x_t.to(self.dtype), self.objective().model_timestep(t), cond.to(self.dtype))
