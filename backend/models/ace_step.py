# SPDX-License-Identifier: GPL-3.0-or-later
"""ACE-Step (text + lyrics to music) through ComfyUI's ``comfy.ldm.ace.model.ACEStepTransformer2DModel``.

The latent is the music DCAE's [8, 16, L] (``ACEAudio``: no scaling), about 10.8 latent frames a second of
44.1 kHz audio. The layers run ComfyUI's own ``encode`` (speaker, genre and lyric embeddings; the speaker is the
zero vector ComfyUI's ``model_base.ACEStep`` gives) and ComfyUI's ``LinearTransformerBlock`` s; what is
re-stated is only ``decode``'s loop:

    AceInput           encode(tags, lyric tokens) -> encoder states; timestep embedding, t_block; proj_in(x_t)
    AceBlock     xN    transformer_blocks[i](x, encoder states, temb), RoPE from ComfyUI's rotary_emb
    AceOutput          final_layer (modulation, unpatchify to the latent's length)

Training is rectified flow with ComfyUI's ACE-Step sampling settings (``supported_models.ACEStep``: shift 3,
``ModelSamplingDiscreteFlow``'s multiplier 1000). The text is UMT5-base's output for the tags and the lyric
token ids of ComfyUI's lyrics tokenizer, as ``TextEncodeAceStepAudio`` makes them (lyrics_strength 1). ComfyUI
runs one conditioning at a time, unmasked; samples of a micro-batch whose tags or lyrics differ in length are
zero-padded and masked with the masks ComfyUI's ``encode`` takes (``text_attention_mask``, ``lyric_mask``), so
each trains as alone. LoRA goes on the attention projections of the transformer blocks (linear self-attention and
cross-attention q, k, v, out; GLUMBConv's feed-forward is 1x1 convolutions and stays frozen).
"""
from __future__ import annotations

import types

import torch
from torch import nn

from .attention import sdpa_transformer_options
from .base import ModelAdapter
from .carry import TupleLayer, hide, reveal, sizes, with_grad
from .checkpointing import BlockLayer
from .spec import ArchSpec, comfy_diffusion_model

ACE_SHIFT = 3.0            # supported_models.ACEStep.sampling_settings
ACE_MULTIPLIER = 1000.0    # ModelSamplingDiscreteFlow's default: ACE-Step's network takes t x 1000
SPEAKER_DIM = 512          # model_base.ACEStep conditions on a zero speaker embedding of this width
SAMPLE_RATE = 44100        # the music DCAE's rate (VAEEncodeAudio resamples to it)
LATENT_HOP = 4096          # audio samples per latent frame (mel hop 512 x the DCAE's 8x)
LYRIC_WIDTH = 1024         # ComfyUI builds the lyric Conformer at this width whatever the config says


def ace_config(**overrides) -> dict:
    """The unet_config ComfyUI's detection gives an ACE-Step v1 3.5B file (``model_detection``: 24 blocks of 20 x 128,
    a lyric vocabulary of 6693 with the structure tags ComfyUI's lyrics tokenizer adds); ``overrides`` narrow it."""
    return {"audio_model": "ace", "attention_head_dim": 128, "in_channels": 8, "inner_dim": 2560, "max_height": 16,
            "max_position": 32768, "max_width": 32768, "mlp_ratio": 2.5, "num_attention_heads": 20, "num_layers": 24,
            "out_channels": 8, "patch_size": [16, 1], "rope_theta": 1000000.0, "speaker_embedding_dim": SPEAKER_DIM,
            "text_embedding_dim": 768, "ssl_encoder_depths": [8, 8], "ssl_latent_dims": [1024, 768],
            "ssl_names": ["mert", "m-hubert"], "lyric_encoder_vocab_size": 6693, "lyric_hidden_size": LYRIC_WIDTH,
            **overrides}


# tiny: 2 blocks of width 64 (2 heads of 32); UMT5-base's 768-wide output and the lyric vocabulary stay real; the
# lyric Conformer is 64 wide with one block (``_narrow_lyric_encoder``)
ACE_CONFIGS = {
    "full": ace_config(),
    "tiny": ace_config(num_layers=2, attention_head_dim=32, num_attention_heads=2, lyric_hidden_size=64,
                       inner_dim=64, ssl_latent_dims=[32, 32]),
}


def ace_step_config(size: str) -> dict:
    return dict(ACE_CONFIGS["full" if size == "full" else "tiny"])


def _narrow_lyric_encoder(unet_config: dict):
    """ComfyUI fixes the lyric Conformer's widths (1024, 6 blocks); a narrower config (``lyric_hidden_size``, a
    tiny file's) builds it at that width with one block."""
    import contextlib

    from ..host.patches_comfyui import narrowed_class

    width = unet_config.get("lyric_hidden_size", LYRIC_WIDTH)
    if width == LYRIC_WIDTH:
        return contextlib.nullcontext()
    return narrowed_class("comfy.ldm.ace.model:LyricEncoder", {"output_size": width, "attention_heads": 2,
                                                                "linear_units": 2 * width, "num_blocks": 1})


ACE_SPEC = ArchSpec(
    title="ACE-Step", comfy_configs=("ACEStep",), unet_config=ace_step_config,
    build=comfy_diffusion_model("comfy.ldm.ace.model:ACEStepTransformer2DModel"), detected_sizes=("full",),
    text_encoders=("umt5_base",), clip_type="ACE", vae="ace_dcae", example_file="ace_step_v1_3.5b.safetensors",
    text_encoder_types=("ace",), building=_narrow_lyric_encoder)


def _padding_masks(text_lengths, text_len: int, lyric_lengths, lyric_len: int, x):
    """(attention_mask over the latent tokens, text mask, lyric mask) as ComfyUI's ``encode`` / blocks take them,
    or three Nones when no sample is padded (ComfyUI's own unmasked path)."""
    if bool((text_lengths >= text_len).all()) and bool((lyric_lengths >= lyric_len).all()):
        return None, None, None
    device = x.device
    text = (torch.arange(text_len, device=device)[None] < text_lengths.to(device)[:, None]).to(x.dtype)
    lyric = (torch.arange(lyric_len, device=device)[None] < lyric_lengths.to(device)[:, None]).to(x.dtype)
    return torch.ones(x.shape[0], x.shape[1], device=device, dtype=x.dtype), text, lyric


class AceInput(TupleLayer):
    cost = 0.1

    def __init__(self, dm, objective, dtype):
        super().__init__()
        self.speaker_embedder, self.genre_embedder = dm.speaker_embedder, dm.genre_embedder
        self.lyric_embs, self.lyric_encoder, self.lyric_proj = dm.lyric_embs, dm.lyric_encoder, dm.lyric_proj
        self.time_proj, self.timestep_embedder, self.t_block = dm.time_proj, dm.timestep_embedder, dm.t_block
        self.proj_in = dm.proj_in
        # ComfyUI's own encode, run over this layer's modules (same attribute names as the model's)
        self.forward_lyric_encoder = types.MethodType(type(dm).forward_lyric_encoder, self)
        self._encode = types.MethodType(type(dm).encode, self)
        self.objective, self.dtype = objective, dtype

    def run(self, latents, noise, t, context, lyrics, text_lengths, lyric_lengths):
        x_t = self.objective.noisy(latents, noise, t).to(self.dtype)
        context = context.to(self.dtype)
        hidden = self.proj_in(x_t)
        _, text_mask, lyric_mask = _padding_masks(text_lengths, context.shape[1], lyric_lengths, lyrics.shape[1],
                                                  hidden)
        speaker = torch.zeros(x_t.shape[0], SPEAKER_DIM, device=x_t.device, dtype=self.dtype)
        encoder_states, _ = self._encode(encoder_text_hidden_states=context, text_attention_mask=text_mask,
                                         speaker_embeds=speaker, lyric_token_idx=lyrics, lyric_mask=lyric_mask)
        embedded_t = self.timestep_embedder(self.time_proj(self.objective.model_timestep(t)).to(self.dtype))
        temb = self.t_block(embedded_t)
        return (with_grad(hidden), hide(encoder_states), hide(temb), hide(embedded_t), text_lengths, lyric_lengths,
                sizes(x_t.shape[-1]))


class AceBlock(BlockLayer):
    def __init__(self, block, rotary_emb, dtype):
        super().__init__(block, dtype)
        self.rotary_emb = rotary_emb

    def block_forward(self, hidden, encoder_states, temb, embedded_t, text_lengths, lyric_lengths, length):
        states = reveal(encoder_states, self.dtype)
        mask, text_mask, lyric_mask = self._masks(hidden, states, text_lengths, lyric_lengths)
        encoder_mask = None if mask is None else torch.cat(
            [torch.ones(hidden.shape[0], 1, device=hidden.device, dtype=hidden.dtype), text_mask, lyric_mask], dim=1)
        hidden = self.block(hidden_states=hidden, attention_mask=mask, encoder_hidden_states=states,
                            encoder_attention_mask=encoder_mask,
                            rotary_freqs_cis=self.rotary_emb(hidden, seq_len=hidden.shape[1]),
                            rotary_freqs_cis_cross=self.rotary_emb(states, seq_len=states.shape[1]),
                            temb=reveal(temb, self.dtype), transformer_options=sdpa_transformer_options())
        return hidden, encoder_states, temb, embedded_t, text_lengths, lyric_lengths, length

    @staticmethod
    def _masks(hidden, states, text_lengths, lyric_lengths):
        lyric_len = int(lyric_lengths.max())   # the padded lyric length: encoder states are [speaker, text, lyrics]
        return _padding_masks(text_lengths, states.shape[1] - 1 - lyric_len, lyric_lengths, lyric_len, hidden)


class AceOutput(TupleLayer):
    cost = 0.05

    def __init__(self, dm, dtype):
        super().__init__()
        self.final_layer, self.dtype = dm.final_layer, dtype

    def run(self, hidden, encoder_states, temb, embedded_t, text_lengths, lyric_lengths, length):
        out = self.final_layer(hidden, reveal(embedded_t, self.dtype), int(length[0]))
        return out.to(torch.promote_types(out.dtype, torch.float32))


class AceStepAdapter(ModelAdapter):
    arch = "ace_step"
    spec = ACE_SPEC
    latent_format = "ACEAudio"
    # the attention projections of every block: the cross-attention's add_q/k/v_proj and to_add_out exist in
    # ComfyUI's block but its processor never runs them here (they would train nothing)
    ATTENTION_LINEARS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "cross_attn.to_q",
                         "cross_attn.to_k", "cross_attn.to_v", "cross_attn.to_out.0")
    text_fields = ("cond", "lyrics")
    audio = True               # trains on audio files (data/audio.py), its latents from encode_audio
    timestep_range = True

    @property
    def lora_block_prefixes(self) -> tuple[str, ...]:
        blocks = len(self.diffusion_model.transformer_blocks) if self.patcher is not None else 0
        return tuple(f"transformer_blocks.{i}.{name}" for i in range(blocks) for name in self.ATTENTION_LINEARS)

    def encode_caption(self, clip, caption):
        return self.encode_song(clip, caption, "")

    def encode_song(self, clip, tags: str, lyrics: str) -> dict[str, torch.Tensor]:
        """Tags and lyrics as ``TextEncodeAceStepAudio`` encodes them: UMT5-base's output for the tags and the
        lyric token ids (ComfyUI's lyrics tokenizer), each without a batch dimension."""
        out = clip.encode_from_tokens(clip.tokenize(tags, lyrics=lyrics), return_dict=True)
        return {"cond": out["cond"][0].float().cpu(), "lyrics": out["conditioning_lyrics"][0].long().cpu()}

    def encode_audio(self, vae, waveform: torch.Tensor, sample_rate: int) -> torch.Tensor:
        """A clip [channels, samples] -> its latent [8, 16, L] as ``VAEEncodeAudio`` encodes it (resampled to
        44.1 kHz first); mono is duplicated to the two channels the DCAE reads."""
        if waveform.shape[0] == 1:
            waveform = waveform.expand(2, -1)
        waveform = waveform[:2].float()
        if sample_rate != SAMPLE_RATE:
            import torchaudio
            waveform = torchaudio.functional.resample(waveform, sample_rate, SAMPLE_RATE)
        return vae.encode(waveform[None].movedim(1, -1)).float().cpu()[0]

    def collate_text(self, items):
        """Tags [B, T, 768] and lyric ids [B, L] zero-padded to the longest, then each sample's lengths."""
        cond = [it["cond"] for it in items]
        lyrics = [it["lyrics"] for it in items]
        n, m = max(c.shape[0] for c in cond), max(ly.shape[0] for ly in lyrics)
        pad = torch.nn.functional.pad
        return [torch.stack([pad(c, (0, 0, 0, n - c.shape[0])) for c in cond]),
                torch.stack([pad(ly, (0, m - ly.shape[0])) for ly in lyrics]),
                torch.tensor([c.shape[0] for c in cond]), torch.tensor([ly.shape[0] for ly in lyrics])]

    def objective(self):
        return self.flow_matching(ACE_SHIFT, ACE_MULTIPLIER)

    def seq_len(self, latent):
        return latent.shape[-1]

    def to_layers(self):
        dm = self.diffusion_model
        return [AceInput(dm, self.objective(), self.dtype),
                *(AceBlock(b, dm.rotary_emb, self.dtype) for b in dm.transformer_blocks),
                AceOutput(dm, self.dtype)]

    def sample_conditioning(self, text, guidance):
        """The CONDITIONING ``TextEncodeAceStepAudio`` outputs for these tags and lyrics (lyrics_strength 1)."""
        return [[text["cond"][None], {"conditioning_lyrics": text["lyrics"][None], "lyrics_strength": 1.0}]]

    def audio_latent(self, seconds: float) -> torch.Tensor:
        """The empty latent of a song ``seconds`` long, as ``EmptyAceStepLatentAudio`` makes it (epoch samples)."""
        from comfy_extras.nodes_ace import EmptyAceStepLatentAudio

        return EmptyAceStepLatentAudio.execute(seconds, 1)[0]["samples"]

    def probe_latent(self, generator, size=(8, 8)):
        return torch.randn(1, 8, 16, size[1], generator=generator)

    def empty_latent(self, width, height):
        return torch.zeros(1, 8, 16, max(1, width // 8))

    def probe_text(self, generator):
        tokens, lyric = 7, 9
        return [torch.randn(1, tokens, self.diffusion_model.genre_embedder.in_features, generator=generator),
                torch.randint(0, self.diffusion_model.lyric_embs.num_embeddings, (1, lyric), generator=generator), torch.tensor([tokens]),
                torch.tensor([lyric])]

    def reference_forward(self, x_t, t, text):
        """ComfyUI's forward one sample at a time with its own (unpadded) tags and lyrics, as ``model_base.ACEStep``
        conditions it (zero speaker embedding, lyrics_strength 1)."""
        cond, lyrics, text_lengths, lyric_lengths = text
        dm, timestep = self.diffusion_model, self.objective().model_timestep(t)
        outs = [dm(x_t[i:i + 1].to(self.dtype), timestep[i:i + 1], context=cond[i:i + 1, :int(text_lengths[i])]
                   .to(self.dtype), lyric_token_idx=lyrics[i:i + 1, :int(lyric_lengths[i])],
                   speaker_embeds=torch.zeros(1, SPEAKER_DIM, dtype=self.dtype))
                for i in range(x_t.shape[0])]
        return torch.cat(outs)
