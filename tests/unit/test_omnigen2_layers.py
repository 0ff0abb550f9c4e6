"""OmniGen2 pipeline layers against ComfyUI's OmniGen2Transformer2DModel (text to image): the same output as
its forward, LoRA gradients equal to finite differences of that forward, training targets ComfyUI's flow
sampling (shift 2.6, multiplier 1) turns back into the clean latent, captions of different lengths batched as
if alone (each sample's image positions after its own caption), and tuples DeepSpeed's pipeline can cut
anywhere; plus the real layout ComfyUI detects and the tiny files."""
import pytest
import torch
from layer_checks import (captions_batch_as_if_alone, comfyui_detects, every_boundary_is_a_stage_boundary_with_lora,
                          flow_targets_agree_with_comfyui, give_lora_b_values, layers_match_comfyui_forward,
                          layout_state_dict, lora_gradients_match_finite_differences, padded_caption_inputs,
                          small_adapter)

from pipetrain.backend.adapters import injection
from pipetrain.backend.config import ModelConfig
from pipetrain.backend.host.runtime import ensure_comfyui

ensure_comfyui()
TEXT = 24   # Qwen2.5-VL-3B's width is 2048


@pytest.fixture(scope="module")
def small_omnigen2():
    """ComfyUI's own ``model_base.Omnigen2`` in float64: width 64 (4 query heads of 16 over 2 key/value heads),
    2 refiner layers per stream, 2 blocks."""
    from pipetrain.backend.models.omnigen2 import OMNIGEN2_FULL, OmniGen2Adapter

    config = {**OMNIGEN2_FULL, "axes_dim_rope": [4, 6, 6], "hidden_size": 64, "num_attention_heads": 4,
              "num_kv_heads": 2, "num_layers": 2, "text_feat_dim": TEXT}
    return small_adapter(OmniGen2Adapter, "omnigen2", config, std=0.1)


def _inputs(batch=2, size=(6, 10), tokens=(5, 5), seed=1):
    return padded_caption_inputs(16, size, tokens, TEXT, batch, seed)[0]


def test_comfyui_detects_the_full_layout_as_omnigen2():
    from pipetrain.backend.models.omnigen2 import OMNIGEN2_FULL

    sd = layout_state_dict("omnigen2", "full")
    comfyui_detects(sd, "omnigen2", "Omnigen2", OMNIGEN2_FULL)


def test_tiny_omnigen2_files_load_through_comfyui(model_files):
    """Qwen2.5-3B through its metadata with the tokenizer and chat template ComfyUI ships: one caption's tokens,
    unpadded; ComfyUI's conditioning (with its attention mask) runs the tiny model."""
    from pipetrain.backend.models import loading
    from pipetrain.backend.models.omnigen2 import OmniGen2Adapter

    files = model_files("omnigen2")
    patcher = loading.load_diffusion_model(files.diffusion_model, torch.float32)
    assert type(patcher.model).__name__ == "Omnigen2"
    assert patcher.model.model_sampling.shift == pytest.approx(2.6) and patcher.model.model_sampling.multiplier == 1.0
    clip = loading.load_text_encoders(files.text_encoders, "omnigen2", torch.float32)
    adapter = OmniGen2Adapter(ModelConfig(type="omnigen2", diffusion_model="unused", vae="unused"))
    cond = adapter.encode_caption(clip, "a red cube on a table")["cond"]
    assert cond.ndim == 2 and cond.shape[1] == 64 and 20 < cond.shape[0] < 60
    model_cond = patcher.model.extra_conds(**adapter.sample_conditioning({"cond": cond}, 1.0)[0][1],
                                           cross_attn=cond[None])
    assert model_cond["num_tokens"].cond == cond.shape[0] and "attention_mask" not in model_cond
    assert loading.load_vae(files.vae, arch="omnigen2").latent_channels == 16


def test_layers_match_comfyui_forward(small_omnigen2):
    a = small_omnigen2
    layers_match_comfyui_forward(a, _inputs(), [
        "OmniInput", "OmniContextRefiner", "OmniContextRefiner", "OmniNoiseRefiner", "OmniNoiseRefiner", "OmniJoin",
        "OmniBlock", "OmniBlock", "OmniOutput"])


def test_training_targets_agree_with_comfyui_flow_sampling(small_omnigen2):
    a = small_omnigen2
    model, objective = a.patcher.model, a.objective()
    ms = model.model_sampling
    assert objective.shift == pytest.approx(2.6) and ms.shift == pytest.approx(2.6)
    assert objective.multiplier == ms.multiplier == 1.0
    x0, noise, t, cond, lengths = inputs = _inputs()
    flow_targets_agree_with_comfyui(a, inputs, c_crossattn=cond, num_tokens=int(lengths[0]))


def test_lora_gradients_match_finite_differences_of_comfyui_forward(small_omnigen2):
    a = small_omnigen2
    dm = a.diffusion_model
    names = injection.inject(dm, injection.AdapterSpec(rank=4, alpha=4.0, dtype=torch.float64), a.lora_block_prefixes)
    # modulated blocks: q/k/v/out + 3 feed-forward + the modulation linear; the context refiner has no modulation
    assert len(names) == 2 * 8 + 2 * 7 + 2 * 8
    assert {"layers.1.attn.to_out.0", "noise_refiner.0.norm1.linear",
            "context_refiner.1.feed_forward.linear_2"} <= set(names)
    give_lora_b_values(dm)
    lora_gradients_match_finite_differences(a, _inputs(tokens=(5, 3)), eps=1e-4, rtol=1e-4)   # float32 RoPE


def test_captions_of_different_lengths_batch_like_comfyui(small_omnigen2):
    a = small_omnigen2
    x0, noise, t, cond, lengths = _inputs(tokens=(7, 3))
    long, short = {"cond": cond[0]}, {"cond": cond[1, :3]}
    collated = captions_batch_as_if_alone(a, x0, noise, t, [long, short])
    assert collated[0].shape == (2, 7, TEXT) and collated[1].tolist() == [7, 3]


def test_every_layer_boundary_can_be_a_deepspeed_stage_boundary(small_omnigen2):
    a = small_omnigen2
    every_boundary_is_a_stage_boundary_with_lora(a, _inputs(tokens=(5, 4)))
