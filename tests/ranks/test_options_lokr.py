"""``[adapter] type = 'lokr'``: the Kronecker-product update, its saved keys read by ComfyUI's own LoKr adapter
(``comfy/weight_adapter/lokr.py``) into the same weight change, and a 2-rank, 2-stage run whose LoKr ComfyUI's
LoraLoaderModelOnly reproduces."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipetrain.backend.adapters import injection
from pipetrain.backend.config import AdapterConfig
from pipetrain.backend.errors import ConfigError
from pipetrain.backend.adapters.lokr import factorization


def test_factorization_matches_lycoris():
    assert factorization(128) == (8, 16) and factorization(128, 4) == (4, 32)
    assert factorization(250, 8) == (5, 50) and factorization(127) == (1, 127)
    assert factorization(3072) == (48, 64)


@pytest.mark.parametrize("rank, factored", [(2, True), (64, False)])
def test_update_and_comfyui_reading_of_the_saved_keys(rank, factored):
    from pipetrain.backend.host.runtime import ensure_comfyui
    ensure_comfyui()
    from comfy.weight_adapter.lokr import LoKrAdapter

    net = nn.Sequential(nn.Linear(48, 96))
    x = torch.randn(3, 5, 48)
    base = net(x)
    spec = injection.spec_from_config(AdapterConfig(type="lokr", rank=rank, alpha=rank / 2), seed=3)
    assert injection.inject(net, spec, ("0",)) == ["0"]
    m = net[0].lokr
    assert m.factored is factored
    assert torch.equal(net(x), base)                     # w1 starts at zero
    m.lokr_w1.data.normal_()
    delta = 0.5 * m.delta_weight()                       # scale = alpha / rank
    torch.testing.assert_close(net(x), base + x @ delta.T, rtol=1e-5, atol=1e-5)
    assert [n for n, p in net.named_parameters() if p.requires_grad] == [f"0.lokr.{n}" for n in (
        ("lokr_w1", "lokr_w2_a", "lokr_w2_b") if factored else ("lokr_w1", "lokr_w2"))]

    sd = injection.state_dict(net)
    assert ("diffusion_model.0.alpha" in sd) is factored
    x_key = "diffusion_model.0"
    alpha = sd[f"{x_key}.alpha"].item() if factored else None
    loaded = LoKrAdapter.load(x_key, sd, alpha, None)
    weight = net[0].weight.detach().clone()
    patched = loaded.calculate_weight(weight.clone(), x_key, 1.0, 1.0, 0, lambda a: a)
    torch.testing.assert_close(patched - weight, delta.detach(), rtol=1e-5, atol=1e-6)

    fresh = nn.Sequential(nn.Linear(48, 96))             # and back into a new adapter (init_from_existing)
    injection.inject(fresh, spec, ("0",))
    assert injection.load_into(fresh, sd) == 1
    torch.testing.assert_close(fresh[0].lokr.delta_weight(), m.delta_weight())


def test_lokr_config_keys():
    from pipetrain.backend.config.schema import from_dict

    cfg = from_dict(AdapterConfig, {"type": "lokr", "rank": 8, "decompose_factor": 4})
    assert (cfg.type, cfg.decompose_factor) == ("lokr", 4)
    with pytest.raises(ConfigError, match="key 'adapter.decompose_factor'.*LoKr option"):
        from_dict(AdapterConfig, {"type": "lora", "decompose_factor": 4}, prefix="adapter")
    with pytest.raises(ConfigError, match="key 'adapter.decompose_factor'"):
        from_dict(AdapterConfig, {"type": "lokr", "decompose_factor": 0}, prefix="adapter")
    with pytest.raises(ConfigError, match="key 'adapter.rank_dropout'.*use dropout"):
        from_dict(AdapterConfig, {"type": "lokr", "rank_dropout": 0.1}, prefix="adapter")


@pytest.mark.slow
def test_two_stage_lokr_run_loads_in_comfyui(micro_flux_files, make_run):
    from conftest import train

    from pipetrain.backend.config import load_run_config
    from pipetrain.backend.parity.verify import check_lora
    from safetensors.torch import load_file

    config = make_run(micro_flux_files, images=4, name="lokr", stages=2, epochs=1, checkpoint_every_n_epochs=None,
                      adapter={"type": "lokr", "rank": 4, "alpha": 2.0, "decompose_factor": 8},
                      optimizer={"type": "adamw", "lr": 1e-2})
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    path = run.loras()[-1]
    sd = load_file(str(path))
    assert not any("lora_" in k for k in sd)
    w1 = [k for k in sd if k.endswith(".lokr_w1")]
    assert w1 and all(k.startswith("diffusion_model.") for k in sd)
    assert any(sd[k].abs().max() > 0 for k in w1)        # trained away from its zero start
    assert any(k.startswith("diffusion_model.double_blocks.") for k in w1)   # stage 0's blocks ...
    assert any(k.startswith("diffusion_model.single_blocks.") for k in w1)   # ... and stage 1's
    check = check_lora(load_run_config(config), path)
    assert check.keys_loaded == len(w1)                  # every LoKr module patched by LoraLoaderModelOnly
    assert check.comfy_vs_training < 1e-4, check
    assert check.lora_effect > 100 * check.comfy_vs_training and check.lora_effect > 1e-4, check
