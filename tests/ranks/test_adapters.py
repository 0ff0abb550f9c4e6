"""Every ``[adapter] type`` (and DoRA) through one interface: ComfyUI's own LoRA loader (``comfy.lora.load_lora``
with ``comfy/weight_adapter``) reads every saved key and, merged into the base weight, gives the output of our
training-side module; the saved tensors load back; gradients reach every trained tensor and the loss falls."""
from __future__ import annotations

import logging
import typing

import pytest
import torch
from torch import nn

from pipetrain.backend.adapters import injection
from pipetrain.backend.adapters import ADAPTERS
from pipetrain.backend.config import AdapterConfig
from pipetrain.backend.errors import ConfigError
from pipetrain.backend.config.schema import from_dict

KINDS = {   # id -> [adapter] table
    "lora": dict(type="lora", rank=4, alpha=2.0),
    "dora": dict(type="lora", rank=4, alpha=2.0, dora=True),
    "lokr": dict(type="lokr", rank=2, alpha=1.0),
    "loha": dict(type="loha", rank=3, alpha=1.5),
    "oft": dict(type="oft", rank=8),
    "oft_constrained": dict(type="oft", rank=8, alpha=0.05),
}
SAVED = {   # the parts ComfyUI's weight_adapter reads for each, after "diffusion_model.0."
    "lora": {"lora_A.weight", "lora_B.weight", "alpha"},
    "dora": {"lora_A.weight", "lora_B.weight", "alpha", "dora_scale"},
    "lokr": {"lokr_w1", "lokr_w2_a", "lokr_w2_b", "alpha"},
    "loha": {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "alpha"},
    "oft": {"oft_blocks", "alpha"},
    "oft_constrained": {"oft_blocks", "alpha"},
}


def _adapted(table: dict, seed: int = 3) -> nn.Sequential:
    """A one-linear model (always the same base weights) with the adapter ``table`` on it, seeded by ``seed``."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(48, 96))
    spec = injection.spec_from_config(from_dict(AdapterConfig, table, prefix="adapter"), seed=seed)
    assert injection.inject(net, spec, ("0",)) == ["0"]
    return net


def _move_away_from_start(net: nn.Module, seed: int = 7) -> None:
    """Every adapter starts as the identity; random values make each tensor matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in injection.trainable_parameters(net):
            p.add_(torch.randn(p.shape, generator=g) * 0.2 * (p.abs().mean() + 0.1))


def _comfy_weight(sd: dict, weight: torch.Tensor, caplog) -> torch.Tensor:
    """The base weight as ComfyUI's LoraLoaderModelOnly patches it with ``sd``; every key must be read."""
    from pipetrain.backend.host.runtime import ensure_comfyui
    ensure_comfyui()
    import comfy.lora

    with caplog.at_level(logging.WARNING):
        patches = comfy.lora.load_lora(sd, {"diffusion_model.0": "0.weight"})
    assert "not loaded" not in caplog.text, caplog.text
    return comfy.lora.calculate_weight([(1.0, patches["0.weight"], 1.0, None, None)], weight.clone(), "0.weight")


@pytest.mark.parametrize("kind", KINDS)
def test_comfyui_reads_the_saved_adapter_into_our_output(kind, caplog):
    table = KINDS[kind]
    net = _adapted(table)
    base_weight, bias = net[0].weight.detach().clone(), net[0].bias.detach().clone()
    x = torch.randn(3, 5, 48, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(net(x), nn.functional.linear(x, base_weight, bias))   # starts as the identity
    _move_away_from_start(net)
    ours = net(x).detach()
    assert (ours - nn.functional.linear(x, base_weight, bias)).abs().max() > 1e-3    # the adapter does something

    sd = injection.state_dict(net)
    assert set(sd) == {f"diffusion_model.0.{p}" for p in SAVED[kind]}
    weight = _comfy_weight(sd, base_weight, caplog)
    torch.testing.assert_close(nn.functional.linear(x, weight, bias), ours, rtol=1e-5, atol=1e-5)

    fresh = _adapted(table, seed=4)                     # the saved tensors load back (init_from_existing)
    assert injection.load_into(fresh, sd) == 1
    torch.testing.assert_close(fresh(x), ours, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_reach_every_tensor_and_the_loss_falls(kind):
    net = _adapted(KINDS[kind])
    teacher = _adapted(KINDS[kind])   # the same start moved away: a target this adapter can reach
    _move_away_from_start(teacher)
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        target = teacher(x)
    params = injection.trainable_parameters(net)
    assert params and all(p.requires_grad for p in params)
    start = [p.detach().clone() for p in params]
    optimizer = torch.optim.Adam(params, lr=1e-2)
    losses = []
    for _ in range(20):
        loss = nn.functional.mse_loss(net(x), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(not torch.equal(p, s) for p, s in zip(params, start))   # every trained tensor moved
    assert not net[0].weight.requires_grad and net[0].weight.grad is None


def test_one_interface_per_type():
    assert set(ADAPTERS) == set(typing.get_args(typing.get_type_hints(AdapterConfig)["type"])) == {
        "lora", "lokr", "loha", "oft"}   # every config type has its kind, and no kind is unreachable
    net = _adapted(KINDS["loha"])
    assert net[0].adapter_kind is ADAPTERS["loha"]
    assert [n for n, p in net.named_parameters() if p.requires_grad] == [
        f"0.loha.hada_w{i}_{s}" for i in (1, 2) for s in ("a", "b")]


def test_oft_block_size_follows_rank_as_comfyui():
    from pipetrain.backend.host.runtime import ensure_comfyui
    ensure_comfyui()
    from comfy.weight_adapter.oft import OFTAdapter

    net = _adapted(dict(type="oft", rank=16))
    expected = OFTAdapter.create_train(net[0].weight, rank=16).oft_blocks.shape
    assert net[0].oft.oft_blocks.shape == expected


@pytest.mark.parametrize("table, key, message", [
    (dict(type="lokr", dora=True), "adapter.dora", "DoRA decomposes a LoRA"),
    (dict(type="oft", dropout=0.1), "adapter.dropout", "no adapter input"),
    (dict(type="oft", alpha=-1.0), "adapter.alpha", "constraint"),
    (dict(type="boft"), "adapter.type", "boft"),
])
def test_adapter_options_are_checked(table, key, message):
    with pytest.raises(ConfigError, match=f"key '{key}'.*{message}|{message}.*key '{key}'"):
        from_dict(AdapterConfig, table, prefix="adapter")


def test_the_adapter_node_builds_and_checks_the_new_options():
    from pipetrain.backend.host.runtime import ensure_comfyui
    ensure_comfyui()
    from pipetrain.backend.config.patch import RunPatch
    from pipetrain.nodes.settings import AdapterNode

    assert AdapterNode.execute(8, 0.0, 0.0, "", type="lora", dora=True).result[0] == RunPatch.of(
        {"rank": 8, "type": "lora", "dora": True, "dropout": 0.0, "decompose_factor": -1}, "adapter")
    assert AdapterNode.execute(8, 0.5, 0.0, "", type="oft").result[0].get("adapter.alpha") == 0.5
    assert "set type to lora" in AdapterNode.validate_inputs(type="loha", dora=True)
    assert "set dropout to 0" in AdapterNode.validate_inputs(type="oft", dropout=0.1)
    assert AdapterNode.validate_inputs(type="oft", dropout=0.0) is True


def test_dora_refuses_a_plain_lora_file():
    sd = injection.state_dict(_adapted(KINDS["lora"]))
    with pytest.raises(ValueError, match="without dora_scale"):
        injection.load_into(_adapted(KINDS["dora"]), sd)


@pytest.mark.parametrize("kind", ["dora", "loha", "oft"])
def test_comfyui_loads_each_kind_on_a_real_model(kind, micro_flux_files, make_run, tmp_path):
    """On ComfyUI's Flux (micro): ``LoraLoaderModelOnly``'s patching of every adapted weight reproduces our
    training layers (``verify.check_lora``), with keys mapped by ComfyUI's own key map."""
    from safetensors.torch import save_file

    from pipetrain.backend.config import load_run_config
    from pipetrain.backend.models.registry import adapter_class
    from pipetrain.backend.host.runtime import ensure_comfyui
    from pipetrain.backend.parity.verify import check_lora

    ensure_comfyui()
    cfg = load_run_config(make_run(micro_flux_files, images=1, adapter=KINDS[kind]))
    model = adapter_class(cfg.model.type)(cfg.model, cfg.resolve)
    model.load_diffusion_model()
    names = injection.inject(model.diffusion_model, injection.spec_from_config(cfg.adapter), model.lora_block_prefixes)
    _move_away_from_start(model.diffusion_model)
    path = tmp_path / f"{kind}.safetensors"
    save_file(injection.state_dict(model.diffusion_model), str(path))
    check = check_lora(cfg, path)
    assert check.keys_loaded == len(names)
    assert check.comfy_vs_training < 1e-4 * max(1.0, check.scale), check
    assert check.lora_effect > 1e-3, check


STARTS_AT_ZERO = {"dora": "lora_B.weight", "loha": "hada_w2_a", "oft": "oft_blocks"}   # moves only by training


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(STARTS_AT_ZERO))
def test_two_stage_run_of_each_new_kind_loads_in_comfyui(kind, micro_flux_files, make_run):
    """A 2-rank, 2-stage run trains the adapter on both stages' blocks, and ComfyUI's LoraLoaderModelOnly
    reproduces the training side with the saved file."""
    from conftest import train
    from safetensors.torch import load_file

    from pipetrain.backend.config import load_run_config
    from pipetrain.backend.parity.verify import check_lora

    # 2 pictures (both bucket shapes), 2 steps: enough to move each kind's zero-start tensors on both stages, and
    # ComfyUI's check of the file does not grow with the number of steps
    config = make_run(micro_flux_files, images=2, name=kind, stages=2, epochs=1, checkpoint_every_n_epochs=None,
                      adapter=KINDS[kind], optimizer={"type": "adamw", "lr": 1e-2})
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    path = run.loras()[-1]
    sd = load_file(str(path))
    moved = [k for k in sd if k.endswith("." + STARTS_AT_ZERO[kind])]
    assert moved and all(k.startswith("diffusion_model.") for k in sd)
    assert any(sd[k].abs().max() > 0 for k in moved)                        # trained away from its zero start
    assert any(k.startswith("diffusion_model.double_blocks.") for k in moved)   # stage 0's blocks ...
    assert any(k.startswith("diffusion_model.single_blocks.") for k in moved)   # ... and stage 1's
    check = check_lora(load_run_config(config), path)
    assert check.keys_loaded == len(moved)
    assert check.comfy_vs_training < 1e-4 * max(1.0, check.scale), check
    assert check.lora_effect > 100 * check.comfy_vs_training and check.lora_effect > 1e-4, check
