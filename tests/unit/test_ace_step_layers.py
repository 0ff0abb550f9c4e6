# SPDX-License-Identifier: GPL-3.0-or-later
"""ACE-Step pipeline layers against ComfyUI's ACEStepTransformer2DModel: the same output as its forward (zero
speaker, lyrics_strength 1, as model_base.ACEStep conditions it), LoRA gradients equal to finite differences of
that forward, training targets ComfyUI's flow sampling (shift 3, multiplier 1000) turns back into the clean latent,
tags and lyrics of different lengths batched as if alone, and tuples DeepSpeed's pipeline can cut anywhere."""
import pytest
import torch
from layer_checks import (captions_batch_as_if_alone, every_boundary_is_a_stage_boundary_with_lora,
                          flow_targets_agree_with_comfyui, give_lora_b_values, layers_match_comfyui_forward,
                          lora_gradients_match_finite_differences, small_adapter)

from pipetrain.backend.adapters import injection
from pipetrain.backend.host.runtime import ensure_comfyui

ensure_comfyui()
CONTEXT = 24


@pytest.fixture(scope="module")
def small_ace():
    """ComfyUI's own ``model_base.ACEStep`` in float64: width 64 (2 heads of 32), 2 blocks, 24-wide tags, the
    lyric Conformer narrowed to 32 wide (one block) as tiny files build it."""
    from pipetrain.backend.models.ace_step import AceStepAdapter, ace_config

    config = ace_config(num_layers=2, attention_head_dim=32, num_attention_heads=2, inner_dim=64, mlp_ratio=4.0,
                        max_position=64, max_width=64,
                        text_embedding_dim=CONTEXT, lyric_hidden_size=32, ssl_latent_dims=[16, 16])
    return small_adapter(AceStepAdapter, "ace_step", config, std=0.05)


def _inputs(batch=2, length=12, tokens=(5, 5), lyrics=(7, 7), seed=1):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(batch, 8, 16, length, generator=g, dtype=torch.float64)
    noise = torch.randn(x0.shape, generator=g, dtype=torch.float64)
    t = torch.tensor([0.25, 0.8, 0.05][:batch], dtype=torch.float64)
    cond = torch.randn(batch, max(tokens), CONTEXT, generator=g, dtype=torch.float64)
    ids = torch.randint(3, 6693, (batch, max(lyrics)), generator=g)   # the structure tags [verse] ... sit past 6680
    for i, (n, m) in enumerate(zip(tokens, lyrics)):
        cond[i, n:] = 0
        ids[i, m:] = 0
    return x0, noise, t, cond, ids, torch.tensor(tokens), torch.tensor(lyrics)


def test_comfyui_detects_the_full_layout_as_ace_step():
    from layer_checks import comfyui_detects, layout_state_dict

    from pipetrain.backend.models.ace_step import ACE_CONFIGS

    comfyui_detects(layout_state_dict("ace_step", "full"), "ace_step", "ACEStep", ACE_CONFIGS["full"])


def test_layers_match_comfyui_forward(small_ace):
    layers_match_comfyui_forward(small_ace, _inputs(), ["AceInput", "AceBlock", "AceBlock", "AceOutput"])


def test_training_targets_agree_with_comfyui_flow_sampling(small_ace):
    a = small_ace
    ms, objective = a.model_sampling, a.objective()
    assert (objective.shift, objective.multiplier) == (pytest.approx(3.0), 1000.0)
    assert ms.shift == pytest.approx(3.0) and ms.multiplier == 1000.0
    x0, noise, t, cond, ids, *_ = inputs = _inputs()
    flow_targets_agree_with_comfyui(a, inputs, c_crossattn=cond, lyric_token_idx=ids,
                                    speaker_embeds=torch.zeros(2, 512, dtype=torch.float64))


def test_lora_gradients_match_finite_differences_of_comfyui_forward(small_ace):
    a = small_ace
    dm = a.diffusion_model
    names = injection.inject(dm, injection.AdapterSpec(rank=4, alpha=4.0, dtype=torch.float64), a.lora_block_prefixes)
    assert len(names) == 2 * 8 and "transformer_blocks.1.cross_attn.to_out.0" in names
    assert not any("add_" in n for n in names)   # projections ComfyUI's processor never runs
    give_lora_b_values(dm)
    # ComfyUI's ACE code keeps its rotary tables and timestep features in float32: the float64 loss carries
    # ~1e-9 of rounding, so the difference step is 1e-4 (at 1e-7 the rounding dominates)
    lora_gradients_match_finite_differences(a, _inputs(), rtol=1e-3, eps=1e-4)


def test_tags_and_lyrics_of_different_lengths_batch_like_comfyui(small_ace):
    a = small_ace
    x0, noise, t, cond, ids, _, _ = _inputs(tokens=(6, 3), lyrics=(4, 9))
    items = [{"cond": cond[0, :6], "lyrics": ids[0, :4]}, {"cond": cond[1, :3], "lyrics": ids[1, :9]}]
    # lyrics pad exactly; padded tags differ from alone by ~6e-7 (float32-level, inside ComfyUI's masked attention)
    collated = captions_batch_as_if_alone(a, x0, noise, t, items, atol=1e-5, rtol=1e-5)
    assert collated[0].shape == (2, 6, CONTEXT) and collated[1].shape == (2, 9)
    assert collated[2].tolist() == [6, 3] and collated[3].tolist() == [4, 9]


def test_every_layer_boundary_can_be_a_deepspeed_stage_boundary(small_ace):
    every_boundary_is_a_stage_boundary_with_lora(small_ace, _inputs(tokens=(5, 4), lyrics=(6, 6)))


def test_bench_probes_a_clip_of_the_given_seconds(small_ace):
    """bench/models.py --seconds: 3 s at 44.1 kHz is round(3 x 44100 / 4096) = 32 latent frames of [8, 16]; the
    probe's tags and lyrics are the adapter's (768-wide UMT5 output is the config's context width here)."""
    from pipetrain.bench.models import probe_inputs

    x0, noise, t, cond, lyrics, text_lengths, lyric_lengths = probe_inputs(small_ace, 1024, 33, "cpu", seconds=3)
    assert x0.shape == noise.shape == (1, 8, 16, 32) and cond.shape == (1, 7, CONTEXT)
    assert lyrics.dtype == torch.int64 and (text_lengths.item(), lyric_lengths.item()) == (7, 9)
