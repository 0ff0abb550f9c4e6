# SPDX-License-Identifier: GPL-3.0-or-later
"""Anima (issue #37) through ComfyUI's ``comfy.ldm.anima.model.Anima``: Cosmos-Predict2's network (``cosmos.py``)
with an LLM adapter in front that turns a Qwen3-0.6B caption into the 1024-wide cross-attention context.

ComfyUI's Anima text encoder gives, per caption, Qwen3-0.6B's last hidden states (no padding, no chat template) and
the caption's T5 token ids and weights (T5's tokenizer only; no T5 weights run). The network's ``llm_adapter`` (six
transformer blocks cross-attending to the Qwen3 states, queried by embeddings of the T5 ids) maps them to the
context, scaled by the T5 weights and zero-padded to 512 tokens (``Anima.preprocess_text_embeds``), which the
Cosmos-Predict2 blocks attend to unmasked. The layers run that adapter per sample on its own lengths (padding
would change what its unmasked attention sees), then Cosmos-Predict2's layers; the adapter stays frozen and LoRA
goes on the DiT blocks (diffusion-pipe's ``llm_adapter_lr`` is refused, ``compat.py``). Latents are Wan 2.1's
(an image is a one-frame clip); the objective is rectified flow with ComfyUI's shift 3 (``[model] shift`` sets
another) and the network takes t itself, as ComfyUI samples Anima (``model_sampling`` FLOW, multiplier 1).

ComfyUI's detection reads Anima from a Cosmos-Predict2 layout with ``llm_adapter`` weights; its class arrived
after 0.8.0 (Comfy-Org/ComfyUI#12012), so an older ComfyUI has no ``comfy.supported_models.Anima`` and the parity
verdict names it. ComfyUI fixes the adapter's widths (1024, six blocks of 16 heads): a tiny file narrows them with
its cross-attention width (``_narrow_llm_adapter``), its config in the file's metadata.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from .cosmos import CosmosPredict2Adapter, Predict2Block, Predict2Input, Predict2Output, predict2_config
from .encoders import TextEncoderKind, comfy_llm_config
from .objectives import FlowMatching
from .spec import ArchSpec, comfy_diffusion_model, comfy_text_model

CONTEXT_WIDTH = 1024        # the LLM adapter's output and Qwen3-0.6B's width, which ComfyUI fixes
CONTEXT_TOKENS = 512        # the context is zero-padded to at least this many tokens
DEFAULT_SHIFT = 3.0         # ComfyUI's Anima sampling_settings
TINY_WIDTH = 64             # the tiny Qwen3-0.6B's and the tiny adapter's width


def anima_config(size: str) -> dict:
    """full: Anima (Cosmos-Predict2 2B's DiT, as ComfyUI's detection gives it); tiny: 2 blocks at width 256 reading a
    64-wide context (the tiny Qwen3-0.6B's), which ComfyUI's detection cannot tell, so it travels in metadata."""
    if size == "full":
        return {**predict2_config(2048, 28, 16), "image_model": "anima"}
    return {**predict2_config(256, 2, 4), "image_model": "anima", "crossattn_emb_channels": TINY_WIDTH}


def _narrow_llm_adapter(unet_config: dict):
    """ComfyUI builds the LLM adapter at its published widths; a config with a narrower context (a tiny file's)
    builds it at that width with two blocks of two heads."""
    from ..host.patches_comfyui import narrowed_class

    width = unet_config.get("crossattn_emb_channels", CONTEXT_WIDTH)
    if width == CONTEXT_WIDTH:
        return contextlib.nullcontext()
    return narrowed_class("comfy.ldm.anima.model:LLMAdapter", {"source_dim": width, "target_dim": width,
                                                                "model_dim": width, "num_layers": 2, "num_heads": 2})


# Qwen3-0.6B (Anima's text encoder; tokenizer shipped with ComfyUI): its last hidden states; the tiny one is 64 wide
# with 2 layers and the real vocabulary
QWEN3_06B = TextEncoderKind("Qwen3-0.6B", comfy_llm_config("Qwen3_06BConfig"),
                            {"hidden_size": TINY_WIDTH, "intermediate_size": 128, "num_hidden_layers": 2,
                             "num_attention_heads": 2, "num_key_value_heads": 1},
                            comfy_text_model("comfy.text_encoders.llama:Qwen3_06B"), "QWEN3_06B")

ANIMA_SPEC = ArchSpec(
    title="Anima", comfy_configs=("Anima",), unet_config=anima_config,
    build=comfy_diffusion_model("comfy.ldm.anima.model:Anima"), detected_sizes=("full",),
    # ComfyUI's Qwen3-0.6B file gives Anima's encoder whatever CLIPLoader type is chosen
    text_encoders=("qwen3_06b",), clip_type="STABLE_DIFFUSION",
    vae="wan21", example_file="anima-preview.safetensors", building=_narrow_llm_adapter,
    text_encoder_kinds={"qwen3_06b": QWEN3_06B})


class AnimaInput(Predict2Input):
    """The LLM adapter on each sample's own caption (frozen), then Cosmos-Predict2's input layer."""

    def __init__(self, dm, objective, dtype):
        super().__init__(dm, objective, dtype)
        self.llm_adapter = dm.llm_adapter
        self._context = dm.preprocess_text_embeds

    def run(self, latents, noise, t, qwen3, qwen3_lengths, t5_ids, t5_lengths, t5_weights):
        with torch.no_grad():
            contexts = [self._context(qwen3[i:i + 1, :int(n)].to(self.dtype), t5_ids[i:i + 1, :int(m)],
                                      t5xxl_weights=t5_weights[i:i + 1, :int(m), None].to(self.dtype))
                        for i, (n, m) in enumerate(zip(qwen3_lengths.tolist(), t5_lengths.tolist()))]
        longest = max(c.shape[1] for c in contexts)
        context = torch.cat([nn.functional.pad(c, (0, 0, 0, longest - c.shape[1])) for c in contexts])
        return super().run(latents, noise, t, context)


class AnimaAdapter(CosmosPredict2Adapter):
    arch = "anima"
    spec = ANIMA_SPEC
    text_fields = ("qwen3", "t5_ids", "t5_weights")

    def encode_caption(self, clip, caption):
        """Qwen3-0.6B's hidden states with the T5 ids and weights ComfyUI's Anima encoder returns beside them."""
        out = clip.encode_from_tokens(clip.tokenize(caption), return_dict=True)
        return {"qwen3": out["cond"][0].float().cpu(), "t5_ids": out["t5xxl_ids"].long().cpu(),
                "t5_weights": out["t5xxl_weights"].float().cpu()}

    def collate_text(self, items):
        """[Qwen3 states zero-padded, their lengths, T5 ids padded, their lengths, T5 weights padded]: the input
        layer runs each caption on its own lengths."""
        def padded(name):
            ts = [it[name] for it in items]
            n = max(x.shape[0] for x in ts)
            return (torch.stack([nn.functional.pad(x, (0, 0) * (x.ndim - 1) + (0, n - x.shape[0])) for x in ts]),
                    torch.tensor([x.shape[0] for x in ts]))
        (qwen3, qwen3_lengths), (ids, id_lengths), (weights, _) = map(padded, self.text_fields)
        return [qwen3, qwen3_lengths, ids, id_lengths, weights]

    def objective(self):
        return FlowMatching.from_model_config(self.cfg, default_shift=DEFAULT_SHIFT, multiplier=1.0)

    def to_layers(self):
        dm = self.diffusion_model
        layers: list[nn.Module] = [AnimaInput(dm, self.objective(), self.dtype)]
        layers += [Predict2Block(b, self.dtype) for b in dm.blocks]
        layers.append(Predict2Output(dm, self.dtype))
        return layers

    def sample_conditioning(self, text, guidance):
        """ComfyUI's CONDITIONING of Anima's encoder: the Qwen3 states, the T5 ids and weights beside them."""
        return [[text["qwen3"][None], {"t5xxl_ids": text["t5_ids"], "t5xxl_weights": text["t5_weights"]}]]

    def probe_text(self, generator):
        width = self.diffusion_model.llm_adapter.blocks[0].cross_attn.context_dim
        ids = torch.randint(0, 32128, (1, 10), generator=generator)
        return self.collate_text([{"qwen3": torch.randn(14, width, generator=generator), "t5_ids": ids[0],
                                   "t5_weights": 0.5 + torch.rand(10, generator=generator)}])

    def reference_forward(self, x_t, t, text):
        qwen3, _, ids, _, weights = text   # one sample, its own lengths
        return self.diffusion_model(x_t.to(self.dtype), self.objective().model_timestep(t), qwen3.to(self.dtype),
                                    t5xxl_ids=ids, t5xxl_weights=weights[..., None].to(self.dtype))

