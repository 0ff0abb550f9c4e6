"""HiDream-I1 (Full / Dev / Fast, 17B) through ComfyUI's ``comfy.ldm.hidream.model``.

ComfyUI's double- and single-stream blocks add their residuals out of place, and their mixture-of-experts
feed-forward (a softmax gate picking 2 of 4 SwiGLU experts per token, plus a shared expert) runs under
autograd as written: the layers call ComfyUI's blocks (attention routed to SDPA) and the gate is trained
through (its top-2 weights carry gradients to the tokens; the gate's own matrix is not a linear and stays
frozen). What is re-stated is ``HiDreamImageTransformer2DModel._forward``'s loop:

    HiDreamInput          x_embedder(patches); t_embedder(1000 t) + p_embedder(pooled); RoPE over
                          [image, text]; the initial text: caption_projection[-1](T5) + the projection of the
                          last Llama layer in use       -> (x, text, adaln, rope, llama, hw, t5_len, llama_len)
    HiDreamDouble   xN    double_stream_blocks[i](x, [text, projection i of Llama layer llama_layers[i]])
    HiDreamJoin           cat(x, text)
    HiDreamSingle   xM    single_stream_blocks[i]([x, text, projection of its Llama layer])
    HiDreamOutput         final_layer, unpatchify, negate (ComfyUI's sign), crop

Each block projects its own Llama layer (``caption_projection[i]``), so the raw Llama hidden states travel
between stages (bit-cast, frozen) instead of 48 projected copies. Training is rectified flow (target
noise - x0; the network takes 1000 t, ComfyUI's ``ModelSamplingDiscreteFlow`` for HiDream, whose shift is 1,
so t is shifted only when ``shift`` is set). The text is ComfyUI's HiDream conditioning: T5-XXL's first 128
tokens, the hidden states of every Llama-3.1-8B layer (``conditioning_llama3``: [32, tokens, 4096], at least
128 tokens), and CLIP-L + CLIP-G pooled (2048). Captions whose Llama sequences differ in length are padded
and the padding masked out as keys in every block, so each sample trains as it would alone. LoRA goes on
every linear of the double and single blocks: adaLN modulation, attention of both streams, the shared and
routed experts and the text feed-forward, as ComfyUI's LoRA loader keys them.
"""
from __future__ import annotations

import torch
from einops import rearrange, repeat
from torch import nn

from .attention import sdpa_transformer_options
from .base import ModelAdapter
from .carry import TupleLayer, hide, reveal, sizes, with_grad
from .checkpointing import BlockLayer
from .spec import ArchSpec, comfy_diffusion_model
from .token_lengths import fit_tokens

LLAMA_PAD = 128009         # ComfyUI's HiDreamTokenizer pad token for Llama 3
DP_LLAMA_TOKENS = 128      # diffusion-pipe's max_llama3_sequence_length default (HiDream's own inference length)

# HiDream-I1 as ComfyUI's detection gives it (model_detection pins every value).
HIDREAM_FULL = {
    "image_model": "hidream", "attention_head_dim": 128, "axes_dims_rope": [64, 32, 32],
    "caption_channels": [4096, 4096], "max_resolution": [128, 128], "in_channels": 16,
    "llama_layers": list(range(32)) + [31] * 16, "num_attention_heads": 20, "num_routed_experts": 4,
    "num_activated_experts": 2, "num_layers": 16, "num_single_layers": 32, "out_channels": 16, "patch_size": 2,
    "text_emb_dim": 2048,
}
# HiDream's structure (4 routed experts, top 2) at width 64 (2 heads of 32), 1 double + 1 single block, taking
# the tiny Llama (4 layers, 64 wide): ComfyUI's detection pins the size, so tiny files carry this config.
HIDREAM_TINY = {**HIDREAM_FULL, "attention_head_dim": 32, "axes_dims_rope": [16, 8, 8], "caption_channels": [4096, 64],
                "llama_layers": [1, 3], "num_attention_heads": 2, "num_layers": 1, "num_single_layers": 1}


def hidream_config(size: str) -> dict:
    return dict(HIDREAM_FULL if size == "full" else HIDREAM_TINY)


HIDREAM_SPEC = ArchSpec(
    title="HiDream-I1", comfy_configs=("HiDream",), unet_config=hidream_config,
    build=comfy_diffusion_model("comfy.ldm.hidream.model:HiDreamImageTransformer2DModel"),
    detected_sizes=("full",), text_encoders=("clip_l", "clip_g", "t5xxl", "llama"), clip_type="HIDREAM",
    vae="kl16", example_file="hidream_i1_full_fp16.safetensors")


def _image_grid(hw, patch_size: int) -> tuple[int, int]:
    return (int(hw[0]) + patch_size - 1) // patch_size, (int(hw[1]) + patch_size - 1) // patch_size


def key_mask(x_len: int, t5_lengths, t5_len: int, llama_lengths, llama_len: int, llama_parts: int = 2):
    """Boolean key mask [B, 1, 1, keys] over [image, T5, Llama x ``llama_parts``] hiding each sample's padding;
    None when nothing is padded."""
    if bool((t5_lengths >= t5_len).all()) and bool((llama_lengths >= llama_len).all()):
        return None
    dev = t5_lengths.device
    image = torch.ones(t5_lengths.shape[0], x_len, dtype=torch.bool, device=dev)
    t5 = torch.arange(t5_len, device=dev)[None] < t5_lengths[:, None]
    llama = torch.arange(llama_len, device=dev)[None] < llama_lengths[:, None]
    return torch.cat([image, t5] + [llama] * llama_parts, dim=1)[:, None, None, :]


class HiDreamInput(TupleLayer):
    cost = 0.05

    def __init__(self, dm, objective, dtype):
        super().__init__()
        # only the embedders and the two projections of the initial text become children
        self.x_embedder, self.t_embedder, self.p_embedder = dm.x_embedder, dm.t_embedder, dm.p_embedder
        self.pe_embedder = dm.pe_embedder
        self.t5_projection = dm.caption_projection[-1]
        self.last_llama_projection = dm.caption_projection[len(dm.llama_layers) - 1]
        self.last_llama_layer = dm.llama_layers[-1]
        self.patch_size, self.objective, self.dtype = dm.patch_size, objective, dtype

    def run(self, latents, noise, t, t5, llama, pooled, t5_lengths, llama_lengths):
        import comfy.ldm.common_dit

        x = self.objective.noisy(latents, noise, t).to(self.dtype)
        b, _, h, w = x.shape
        p = self.patch_size
        x = comfy.ldm.common_dit.pad_to_patch_size(x, (p, p))
        ph, pw = x.shape[-2] // p, x.shape[-1] // p
        x = self.x_embedder(rearrange(x, "B C (H p1) (W p2) -> B (H W) (p1 p2 C)", p1=p, p2=p))
        adaln = self.t_embedder(self.objective.model_timestep(t), x.dtype) + self.p_embedder(pooled.to(self.dtype))
        llama = llama.to(self.dtype)
        text = torch.cat([self.t5_projection(t5.to(self.dtype)),
                          self.last_llama_projection(llama[:, self.last_llama_layer])], dim=1)
        img_ids = torch.zeros(ph, pw, 3, device=x.device)
        img_ids[..., 1] = img_ids[..., 1] + torch.arange(ph, device=x.device)[:, None]
        img_ids[..., 2] = img_ids[..., 2] + torch.arange(pw, device=x.device)[None, :]
        img_ids = repeat(img_ids, "h w c -> b (h w) c", b=b)
        txt_ids = torch.zeros(b, t5.shape[1] + 2 * llama.shape[2], 3, device=x.device, dtype=img_ids.dtype)
        rope = self.pe_embedder(torch.cat((img_ids, txt_ids), dim=1))
        hw = sizes(h, w)
        return (with_grad(x), with_grad(text), hide(adaln), hide(rope.float()), hide(llama), hw,
                t5_lengths, llama_lengths)


class _Block(BlockLayer):
    def __init__(self, block, projection, llama_layer: int, patch_size: int, dtype):
        super().__init__(block, dtype)
        self.caption_projection, self.llama_layer, self.patch_size = projection, llama_layer, patch_size

    def llama_tokens(self, llama):
        return self.caption_projection(reveal(llama, self.dtype)[:, self.llama_layer])

    def options(self, x_len, hw, llama, t5_lengths, llama_lengths):
        llama_len = llama.shape[2]
        ph, pw = _image_grid(hw, self.patch_size)
        t5_len = x_len - ph * pw - 2 * llama_len
        return sdpa_transformer_options(key_mask(ph * pw, t5_lengths, t5_len, llama_lengths, llama_len))


class HiDreamDouble(_Block):
    def block_forward(self, x, text, adaln, rope, llama, hw, t5_lengths, llama_lengths):
        keys = x.shape[1] + text.shape[1] + llama.shape[2]
        x, out = self.block(image_tokens=x, image_tokens_masks=None,
                            text_tokens=torch.cat([text, self.llama_tokens(llama)], dim=1),
                            adaln_input=reveal(adaln, self.dtype), rope=reveal(rope, torch.float32),
                            transformer_options=self.options(keys, hw, llama, t5_lengths, llama_lengths))
        return x, out[:, :text.shape[1]], adaln, rope, llama, hw, t5_lengths, llama_lengths


class HiDreamJoin(TupleLayer):
    cost = 0.0

    def run(self, x, text, adaln, rope, llama, hw, t5_lengths, llama_lengths):
        return torch.cat([x, text], dim=1), adaln, rope, llama, hw, t5_lengths, llama_lengths


class HiDreamSingle(_Block):
    def block_forward(self, h, adaln, rope, llama, hw, t5_lengths, llama_lengths):
        joint = torch.cat([h, self.llama_tokens(llama)], dim=1)
        out = self.block(image_tokens=joint, image_tokens_masks=None, text_tokens=None,
                         adaln_input=reveal(adaln, self.dtype), rope=reveal(rope, torch.float32),
                         transformer_options=self.options(joint.shape[1], hw, llama, t5_lengths, llama_lengths))
        return out[:, :h.shape[1]], adaln, rope, llama, hw, t5_lengths, llama_lengths


class HiDreamOutput(TupleLayer):
    cost = 0.05

    def __init__(self, dm, dtype):
        super().__init__()
        self.final_layer, self.patch_size, self.dtype = dm.final_layer, dm.patch_size, dtype

    def run(self, h, adaln, rope, llama, hw, t5_lengths, llama_lengths):
        ph, pw = _image_grid(hw, self.patch_size)
        out = self.final_layer(h[:, :ph * pw], reveal(adaln, self.dtype))
        p = self.patch_size
        out = rearrange(out, "B (H W) (p1 p2 C) -> B C (H p1) (W p2)", H=ph, W=pw, p1=p, p2=p)
        out = -out[:, :, :int(hw[0]), :int(hw[1])]
        return out.to(torch.promote_types(out.dtype, torch.float32))


class HiDreamAdapter(ModelAdapter):
    arch = "hidream"
    spec = HIDREAM_SPEC
    dp_token_length_key = "max_llama3_sequence_length"
    dp_llama3_path = True
    # the Diffusers HiDream transformer's keys are ComfyUI's own, as are its Flux VAE's and CLIP / T5 folders' after
    # ComfyUI's conversions; the Llama comes from llama3_path, as in diffusion-pipe
    dp_diffusers_folder = True
    dp_folder_pipeline = "HiDreamImage"
    latent_format = "Flux"
    lora_block_prefixes = ("double_stream_blocks", "single_stream_blocks")
    samples_first = False   # the routed experts' linears see the tokens each expert picked, from any sample
    text_fields = ("t5", "llama", "pooled")

    def encode_caption(self, clip, caption):
        tokens = clip.tokenize(caption)
        # diffusion-pipe's max_llama3_sequence_length (default 128): the Llama tokens, its start token counted, cut
        # and padded to this many
        length = self.cfg.max_llama3_sequence_length or DP_LLAMA_TOKENS
        tokens["llama"] = [fit_tokens(tokens["llama"][0], length, LLAMA_PAD, keep_last=False)]
        out = clip.encode_from_tokens(tokens, return_pooled=True, return_dict=True)
        return {"t5": out["cond"][0].float().cpu(), "llama": out["conditioning_llama3"][0].float().cpu(),
                "pooled": out["pooled_output"][0].float().cpu()}

    def text_options(self):
        return {"llama_tokens": self.cfg.max_llama3_sequence_length or DP_LLAMA_TOKENS}

    def collate_text(self, items):
        """T5 tokens [B, T, 4096] and Llama layers [B, layers, L, 4096] zero-padded along their tokens, pooled
        [B, 2048], and each caption's T5 and Llama token counts (the layers mask the padding)."""
        pad = torch.nn.functional.pad
        t5_len = max(it["t5"].shape[0] for it in items)
        llama_len = max(it["llama"].shape[1] for it in items)
        t5 = torch.stack([pad(it["t5"], (0, 0, 0, t5_len - it["t5"].shape[0])) for it in items])
        llama = torch.stack([pad(it["llama"], (0, 0, 0, llama_len - it["llama"].shape[1])) for it in items])
        pooled = torch.stack([it["pooled"] for it in items])
        return [t5, llama, pooled, torch.tensor([it["t5"].shape[0] for it in items]),
                torch.tensor([it["llama"].shape[1] for it in items])]

    def objective(self):
        return self.flow_matching(default_multiplier=1000.0)

    def to_layers(self):
        dm = self.diffusion_model
        n_double = len(dm.double_stream_blocks)
        blocks = [(b, i) for i, b in enumerate(dm.double_stream_blocks)]
        layers: list[nn.Module] = [HiDreamInput(dm, self.objective(), self.dtype)]
        layers += [HiDreamDouble(b, dm.caption_projection[i], dm.llama_layers[i], dm.patch_size, self.dtype)
                   for b, i in blocks]
        layers.append(HiDreamJoin())
        layers += [HiDreamSingle(b, dm.caption_projection[n_double + i], dm.llama_layers[n_double + i], dm.patch_size,
                                 self.dtype) for i, b in enumerate(dm.single_stream_blocks)]
        layers.append(HiDreamOutput(dm, self.dtype))
        return layers

    def sample_conditioning(self, text, guidance):
        return [[text["t5"][None], {"pooled_output": text["pooled"][None], "conditioning_llama3": text["llama"][None]}]]

    def probe_text(self, generator):
        dm = self.diffusion_model
        t5_tokens, llama_tokens = 16, 12
        llama_width = dm.caption_projection[0].linear.in_features
        return [torch.randn(1, t5_tokens, dm.caption_projection[-1].linear.in_features, generator=generator),
                torch.randn(1, max(dm.llama_layers) + 1, llama_tokens, llama_width, generator=generator),
                torch.randn(1, dm.p_embedder.pooled_embedder.linear_1.in_features, generator=generator),
                torch.tensor([t5_tokens]), torch.tensor([llama_tokens])]

    def reference_forward(self, x_t, t, text):
        """ComfyUI's HiDream forward, one sample at a time with its own (unpadded) caption."""
        t5, llama, pooled, t5_lengths, llama_lengths = text
        dm, timestep = self.diffusion_model, self.objective().model_timestep(t)
        outs = []
        for i in range(x_t.shape[0]):
            outs.append(dm(x_t[i:i + 1].to(self.dtype), timestep[i:i + 1], y=pooled[i:i + 1].to(self.dtype),
                           context=t5[i:i + 1, :int(t5_lengths[i])].to(self.dtype),
                           encoder_hidden_states_llama3=llama[i:i + 1, :, :int(llama_lengths[i])].to(self.dtype)))
        return torch.cat(outs)
