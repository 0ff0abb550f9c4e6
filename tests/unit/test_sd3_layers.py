"""SD3 pipeline layers against ComfyUI's MMDiT: the same output as its forward, LoRA gradients equal to
finite differences of that forward, training targets ComfyUI's flow sampling turns back into the clean
latent, captions of different lengths batched as if alone, and tuples DeepSpeed's pipeline can cut anywhere."""
import pytest
import torch
from layer_checks import (captions_batch_as_if_alone, comfy_model, every_boundary_is_a_stage_boundary_with_lora,
                          flow_targets_agree_with_comfyui, give_lora_b_values, layers_match_comfyui_forward,
                          lora_gradients_match_finite_differences, padded_caption_inputs)

from pipetrain.backend.adapters import injection
from pipetrain.backend.config import ModelConfig
from pipetrain.backend.host.runtime import ensure_comfyui

CONTEXT, POOLED = 48, 32   # SD3's are 4096 and 2048
ensure_comfyui()


@pytest.fixture(scope="module")
def small_sd3():
    """ComfyUI's own ``model_base.SD3`` in float64: 2 joint blocks of width 128, RMS q/k norm, SD3.5's second
    image attention in block 0."""
    ensure_comfyui()
    from pipetrain.backend.models.sd3 import SD3Adapter, mmdit_config

    config = mmdit_config(2, 8, x_block_self_attn_layers=[0])
    config["adm_in_channels"] = POOLED
    config["context_embedder_config"]["params"]["in_features"] = CONTEXT
    adapter = SD3Adapter(ModelConfig(type="sd3", diffusion_model="unused", vae="unused"))
    adapter.dtype = torch.float64
    adapter.use_model(comfy_model("sd3", config))
    return adapter


def _inputs(batch=2, size=(6, 10), tokens=(5, 5), seed=1):
    (x0, noise, t, cond, lengths), g = padded_caption_inputs(16, size, tokens, CONTEXT, batch, seed)
    pooled = torch.randn(batch, POOLED, generator=g, dtype=torch.float64)
    return x0, noise, t, cond, pooled, lengths


def test_comfyui_detects_the_tiny_and_full_layouts_as_sd3():
    import comfy.model_detection
    import comfy.supported_models

    from pipetrain.backend.models import loading, tiny
    from pipetrain.backend.models.sd3 import SD3_CONFIGS

    for size in ("tiny", "full"):
        module = tiny.build_diffusion_model("sd3", size)
        sd = {k: torch.empty(s, device="meta") for k, s, _ in tiny.tensor_plan(module)}
        assert type(comfy.model_detection.model_config_from_unet(sd, "")) is comfy.supported_models.SD3
        assert comfy.model_detection.detect_unet_config(sd, "") == SD3_CONFIGS[size]
        assert loading.arch_from_state_dict_shapes({k: v.shape for k, v in sd.items()}) == "sd3"


def test_layers_match_comfyui_forward(small_sd3):
    a = small_sd3
    layers_match_comfyui_forward(a, _inputs(), ["SD3Input", "SD3Block", "SD3Block", "SD3Output"])


def test_training_targets_agree_with_comfyui_flow_sampling(small_sd3):
    """The noisy latent and timestep the MMDiT sees in training are what ComfyUI's ``apply_model`` feeds it
    (sigma = t, timestep = 1000 t), and a perfect prediction of the target denoises to the clean latent."""
    a = small_sd3
    model, objective = a.patcher.model, a.objective()
    ms = model.model_sampling
    assert (objective.shift, objective.multiplier) == (3.0, 1000.0) == (ms.shift, ms.multiplier)
    x0, noise, t, cond, pooled, lengths = inputs = _inputs()
    flow_targets_agree_with_comfyui(a, inputs, c_crossattn=cond, y=pooled)


def test_lora_gradients_match_finite_differences_of_comfyui_forward(small_sd3):
    a = small_sd3
    dm = a.diffusion_model
    names = injection.inject(dm, injection.AdapterSpec(rank=4, alpha=4.0, dtype=torch.float64), a.lora_block_prefixes)
    assert "joint_blocks.0.x_block.attn2.qkv" in names and "joint_blocks.1.context_block.adaLN_modulation.1" in names
    linears = [n for n, m in dm.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("joint_blocks.")
               and n.split(".")[-1] not in ("lora_A", "lora_B")]
    assert sorted(names) == sorted(linears)
    give_lora_b_values(dm)
    lora_gradients_match_finite_differences(a, _inputs(tokens=(5, 3)))


def test_captions_of_different_lengths_batch_like_comfyui(small_sd3):
    a = small_sd3
    x0, noise, t, cond, pooled, lengths = _inputs(tokens=(7, 3))
    short, long = {"cond": cond[1, :3], "pooled": pooled[1]}, {"cond": cond[0], "pooled": pooled[0]}
    collated = captions_batch_as_if_alone(a, x0, noise, t, [long, short])
    assert collated[0].shape == (2, 7, CONTEXT) and collated[2].tolist() == [7, 3]


def test_every_layer_boundary_can_be_a_deepspeed_stage_boundary(small_sd3):
    a = small_sd3
    every_boundary_is_a_stage_boundary_with_lora(a, _inputs(tokens=(5, 4)))
