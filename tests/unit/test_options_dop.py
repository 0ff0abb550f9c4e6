# SPDX-License-Identifier: GPL-3.0-or-later
"""Differential output preservation (``diff_output_preservation``): under ``injection.base_rows`` the last third of
every adapted layer's rows is the base layer's output exactly, for each adapter type, and through a Flux model's
pipeline layers the target rows are the base model's prediction on the preservation caption while the middle rows are
the adapted one's; the loss adds the multiplier times the preservation loss against the detached target and keeps it
apart; the feed builds the rows; the preservation caption swaps whole words and has its own cache key; the config
names its keys; the LoRA Adapter node sets them."""
from __future__ import annotations

import pytest
import torch
from feed_stubs import FlowAdapter, Store, cache_entries
from layer_checks import give_lora_b_values, run_layers, small_flux_adapter
from torch import nn

from pipetrain.backend.adapters import injection
from pipetrain.backend.adapters import ADAPTERS
from pipetrain.backend.config import RunConfig
from pipetrain.backend.errors import ConfigError
from pipetrain.backend.host.runtime import ensure_comfyui
from pipetrain.backend.config.schema import from_dict
from pipetrain.backend.train.feed import MicroBatchFeed
from pipetrain.backend.train.preservation import PARTS, PreservationLoss, has_trigger, preservation_caption
from pipetrain.backend.train.reg_loss import SplitLoss, StepSums, group_losses


def _adapted(kind: str, dora: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 8)).double()
    base = [m.weight.detach().clone() for m in model if isinstance(m, nn.Linear)]
    spec = injection.AdapterSpec(rank=4, alpha=4.0, dtype=torch.float64, kind=kind, dora=dora)
    injection.inject(model, spec, ("0", "2"))
    with torch.no_grad():   # every type moves away from the base layer (several start as the identity)
        g = torch.Generator().manual_seed(3)
        for p in injection.trainable_parameters(model):
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.2)
    assert all(torch.equal(w, m.weight) for w, m in zip(base, [model[0], model[2]]))
    return model


def _base_output(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's output with its base weights alone: each linear's own forward, hooks left out."""
    h = x
    for m in model:
        h = nn.functional.linear(h, m.weight, m.bias) if isinstance(m, nn.Linear) else m(h)
    return h


@pytest.mark.parametrize("kind, dora", [(k, False) for k in sorted(ADAPTERS)] + [("lora", True)])
def test_the_last_third_of_the_rows_sees_the_base_layers_alone(kind, dora):
    model = _adapted(kind, dora)
    x = torch.randn(6, 5, 8, dtype=torch.float64)       # 2 samples x 3 parts, 5 tokens each
    adapted = model(x)
    with injection.base_rows(PARTS):
        out = model(x)
    base = _base_output(model, x)
    assert torch.equal(out[4:], base[4:])                # the target rows: the base model, bit for bit
    assert torch.allclose(out[:4], adapted[:4], rtol=0, atol=1e-12)
    assert (out[2:4] - base[2:4]).abs().max() > 1e-3     # the adapter acts on the other rows
    out[4:].sum().backward()                             # and the target rows send it no gradient
    assert all(p.grad is None or not p.grad.any() for p in injection.trainable_parameters(model))
    assert torch.equal(model(x), adapted)                # off again after the block


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_in_bfloat16_the_target_rows_are_the_base_output_bit_for_bit():
    model = _adapted("lora").to("cuda", torch.bfloat16)
    x = torch.randn(6, 5, 8, device="cuda", dtype=torch.bfloat16)
    with injection.base_rows(PARTS):
        out = model(x)
    assert torch.equal(out[4:], _base_output(model, x)[4:])
    assert (out[2:4].float() - _base_output(model, x)[2:4].float()).abs().max() > 1e-2


def test_rows_not_in_three_equal_parts_are_refused():
    model = _adapted("lora")
    with injection.base_rows(PARTS), pytest.raises(RuntimeError, match="not 3 equal parts"):
        model(torch.randn(4, 8, dtype=torch.float64))


def test_through_flux_layers_the_target_is_the_base_models_prediction_on_the_preservation_caption():
    a = small_flux_adapter(depth=1, single_blocks=1)
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(2, 16, 4, 6, generator=g, dtype=torch.float64)
    noise, t = torch.randn(x0.shape, generator=g, dtype=torch.float64), torch.tensor([0.3, 0.7], dtype=torch.float64)
    ctx, kept_ctx = (torch.randn(2, 5, 48, generator=g, dtype=torch.float64) for _ in range(2))
    pooled, kept_pooled = (torch.randn(2, 32, generator=g, dtype=torch.float64) for _ in range(2))

    def three(x):
        return torch.cat([x] * PARTS)
    rows = (three(x0), three(noise), three(t), torch.cat([ctx, kept_ctx, kept_ctx]),
            torch.cat([pooled, kept_pooled, kept_pooled]))
    with torch.no_grad():
        base = run_layers(a.to_layers(), (x0, noise, t, kept_ctx, kept_pooled))   # no adapter yet: the base model
    injection.inject(a.diffusion_model, injection.AdapterSpec(rank=4, alpha=4.0, dtype=torch.float64),
                     a.lora_block_prefixes)
    give_lora_b_values(a.diffusion_model, std=0.2)
    layers = a.to_layers()
    with torch.no_grad():
        main = run_layers(layers, (x0, noise, t, ctx, pooled))
        kept = run_layers(layers, (x0, noise, t, kept_ctx, kept_pooled))
    with injection.base_rows(PARTS):
        out = run_layers(layers, rows)
    assert torch.allclose(out[4:], base, rtol=0, atol=1e-12)      # the target: the base model's prediction
    assert torch.allclose(out[:2], main, rtol=0, atol=1e-12)      # the training rows: the adapted model's
    assert torch.allclose(out[2:4], kept, rtol=0, atol=1e-12)     # the preservation rows: adapted, other caption
    assert (kept - base).abs().max() > 1e-3 and (kept - main).abs().max() > 1e-3

    loss_fn = PreservationLoss(a.loss, a.preservation_loss, 0.5, StepSums())
    loss = loss_fn(out, (x0, noise, t))
    expected = a.loss(main, (x0, noise, t)) + 0.5 * nn.functional.mse_loss(kept, base)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-10)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().max() > 0 for p in injection.trainable_parameters(a.diffusion_model))


def _mse(pred, labels):
    return ((pred - labels[0]) ** 2).mean()


def test_the_loss_adds_the_weighted_preservation_loss_against_the_detached_target_and_logs_it():
    sums = StepSums()
    loss_fn = PreservationLoss(SplitLoss(_mse, sums), lambda p, q: ((p - q) ** 2).mean(), 0.25, sums)
    pred = torch.tensor([[1.0, 1.0], [0.0, 2.0], [3.0, 0.0], [1.0, 0.0], [0.0, 0.0], [2.0, 2.0]], requires_grad=True)
    target, reg = torch.zeros(2, 2), torch.tensor([False, True])
    loss = loss_fn(pred, (target, target, target, reg))
    # training rows: 1 and 2 (mean 1.5); preservation [3, 0] vs [0, 0] and [1, 0] vs [2, 2]: (9 + 0 + 1 + 4) / 4
    assert loss.item() == pytest.approx(1.5 + 0.25 * 3.5)
    loss.backward()
    assert not pred.grad[4:].any() and pred.grad[2:4].any()     # the target rows are detached
    assert group_losses(sums.step_sums(1, torch.device("cpu"))) == {
        "reg_samples": 1, "loss_reg": 2.0, "loss_main": 1.0, "loss_dop": 3.5}
    # an eval batch (as many rows as labels) is the training loss alone, not counted
    assert loss_fn(pred[:2], (target,)).item() == pytest.approx(1.5) and sums.sums is None
    zero = PreservationLoss(_mse, lambda p, q: ((p - q) ** 2).mean(), 0.0, StepSums())
    assert zero(pred, (target,)).item() == _mse(pred[:2], (target,)).item()   # multiplier 0: the training loss


def test_the_feed_adds_the_preservation_rows_with_their_captions_and_keeps_the_labels_of_the_training_rows():
    entries = cache_entries(2)
    store = Store()
    plain = MicroBatchFeed(FlowAdapter(), store, seed=5, dp_rank=0, dp_world=1)
    dop = MicroBatchFeed(FlowAdapter(), store, seed=5, dp_rank=0, dp_world=1,
                         preservation_text={"text0": "kept0", "text1": "kept1"})
    (x0, noise, t, text), labels = plain.build(entries, epoch=1, step=0, micro=0)
    (x0_3, noise_3, t_3, text_3), labels_3 = dop.build(entries, epoch=1, step=0, micro=0)
    for one, three in ((x0, x0_3), (noise, noise_3), (t, t_3)):
        assert torch.equal(three, torch.cat([one] * 3))      # the same noisy latent in every part
    ids = [store.ids[k] for k in ("text0", "text1", "kept0", "kept1", "kept0", "kept1")]
    assert text_3.flatten().tolist() == ids
    assert all(torch.equal(a, b) for a, b in zip(labels, labels_3))


def test_the_preservation_caption_swaps_the_trigger_as_a_word_and_has_its_own_cache_key():
    from pipetrain.backend.cache import text_key

    assert preservation_caption("sks, a photo of sks smiling; asks sks.", "sks", "person") == \
        "person, a photo of person smiling; asks person."
    assert preservation_caption("a [v] dog", "[v]", "corgi") == "a corgi dog"
    assert has_trigger("photo of sks", "sks") and not has_trigger("tasks done", "sks")
    keys = {text_key(preservation_caption("sks dog", "sks", c), ["te"], "flux") for c in ("dog", "animal")}
    assert len(keys) == 2 and text_key("sks dog", ["te"], "flux") not in keys


BASE = {"output_dir": "/out", "dataset": "/d.toml", "model": {"type": "flux", "diffusion_model": "/m", "vae": "/v"},
        "adapter": {"type": "lora", "rank": 4}}


def test_the_config_reads_the_keys_with_their_defaults():
    cfg = from_dict(RunConfig, {**BASE, "diff_output_preservation": True, "trigger_word": "sks"})
    assert (cfg.preservation_class, cfg.preservation_multiplier) == ("person", 1.0)
    cfg = from_dict(RunConfig, {**BASE, "diff_output_preservation": True, "trigger_word": "sks",
                                "diff_output_preservation_class": "dog", "diff_output_preservation_multiplier": 0.5})
    assert (cfg.preservation_class, cfg.preservation_multiplier) == ("dog", 0.5)


@pytest.mark.parametrize("keys, key, message", [
    ({"diff_output_preservation": True}, "trigger_word", "set trigger_word"),
    ({"diff_output_preservation": True, "trigger_word": "  "}, "trigger_word", "set trigger_word"),
    ({"diff_output_preservation": True, "trigger_word": "sks", "diff_output_preservation_class": "sks"},
     "diff_output_preservation_class", "other than the trigger word"),
    ({"diff_output_preservation": True, "trigger_word": "sks", "diff_output_preservation_multiplier": -1.0},
     "diff_output_preservation_multiplier", "must be 0 or more"),
    ({"trigger_word": "sks"}, "trigger_word", "set diff_output_preservation = true too"),
    ({"diff_output_preservation_class": "dog"}, "diff_output_preservation_class", "set diff_output_preservation"),
    ({"diff_output_preservation_multiplier": 2.0}, "diff_output_preservation_multiplier", "set diff_output_pres"),
])
def test_wrong_keys_are_named(keys, key, message):
    with pytest.raises(ConfigError, match=f"key '{key}': .*{message}"):
        from_dict(RunConfig, {**BASE, **keys})


def test_a_full_fine_tune_has_no_adapter_to_turn_off():
    no_adapter = {k: v for k, v in BASE.items() if k != "adapter"}
    with pytest.raises(ConfigError, match="key 'diff_output_preservation': .*full fine-tune"):
        from_dict(RunConfig, {**no_adapter, "diff_output_preservation": True, "trigger_word": "sks"})


def test_the_adapter_node_sets_the_keys():
    ensure_comfyui()
    from pipetrain.nodes.settings import AdapterNode

    on = AdapterNode.execute(8, 0.0, 0.0, "", diff_output_preservation=True, trigger_word=" sks ",
                             diff_output_preservation_class="dog", diff_output_preservation_multiplier=0.5).result[0]
    assert {k: on.get(k) for k in ("diff_output_preservation", "trigger_word", "diff_output_preservation_class",
                                   "diff_output_preservation_multiplier")} == {
        "diff_output_preservation": True, "trigger_word": "sks", "diff_output_preservation_class": "dog",
        "diff_output_preservation_multiplier": 0.5}
    off = AdapterNode.execute(8, 0.0, 0.0, "", diff_output_preservation=False, trigger_word="sks").result[0]
    assert off.get("diff_output_preservation") is None and off.get("trigger_word") is None
    assert "trigger_word" in AdapterNode.validate_inputs(diff_output_preservation=True, trigger_word="")
    assert "full" in AdapterNode.validate_inputs(type="full", diff_output_preservation=True, trigger_word="sks")
    assert AdapterNode.validate_inputs(diff_output_preservation=True, trigger_word="sks") is True


@pytest.mark.parametrize("arch", ["hidream", "cosmos"])   # cosmos: Cosmos-Predict1 (cosmos1.py)
def test_models_whose_layers_see_the_samples_elsewhere_are_refused(arch):
    from pipetrain.backend.preflight import check_preservation

    keys = {**BASE, "diff_output_preservation": True, "trigger_word": "sks"}
    check_preservation(from_dict(RunConfig, keys))      # flux: the samples come first
    with pytest.raises(ConfigError, match=f"key 'diff_output_preservation': a {arch} model's adapted layers"):
        check_preservation(from_dict(RunConfig, {**keys, "model": {**BASE["model"], "type": arch}}))


def test_compiled_layers_follow_base_rows_in_and_out():
    """``compile = true``: the rows switch is a module global read inside the compiled forward, so a graph traced
    without it must not be replayed under it (nor the other way round): Dynamo guards on the global and traces again."""
    model = _adapted("lora")
    x = torch.randn(6, 5, 8, dtype=torch.float64)
    adapted, base = model(x), _base_output(model, x)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=False)
    assert torch.allclose(compiled(x), adapted, rtol=0, atol=1e-12)       # traced without base rows first
    with injection.base_rows(PARTS):
        out = compiled(x)
    assert torch.equal(out[4:], base[4:])
    assert (out[2:4] - base[2:4]).abs().max() > 1e-3
    assert torch.allclose(compiled(x), adapted, rtol=0, atol=1e-12)       # and back without them
