"""``blocks_to_swap``: the swapped blocks' frozen weights really leave the model between uses (an empty
placeholder stands in) and come back for every forward and backward, and the loss and the adapter gradients
equal those without swapping, with and without activation checkpointing; a 2-stage DeepSpeed run with
block swapping trains exactly like one without."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import micro_flux_with_lora
from layer_checks import checkpointed_layers

from pipetrain.backend.adapters import injection
from pipetrain.backend.errors import ConfigError
from pipetrain.backend.train.swap import BlockSwapper, enable_block_swap, swappable_module


@pytest.fixture(scope="module")
def flux(micro_flux_files):
    return micro_flux_with_lora(micro_flux_files)


def _step(adapter, inputs, mode, swap: int):
    x0, noise, t, text = inputs
    layers = checkpointed_layers(adapter, mode)
    swapper, seen = None, []
    if swap:
        chosen = [layer for layer in layers if swappable_module(layer) is not None][-swap:]
        swapper = BlockSwapper([swappable_module(layer) for layer in chosen], "cpu", record=True)
        swapper.attach(chosen)
    torch.manual_seed(11)   # LoRA dropout masks
    h = (x0, noise, t, *text)
    for layer in layers:
        h = layer(h)
        if swapper is not None:   # after each layer's forward no swapped block is resident
            seen.append([slot.resident for slot in swapper.slots])
    loss = adapter.loss(h, (x0, noise, t))
    params = injection.trainable_parameters(adapter.diffusion_model)
    for p in params:
        p.grad = None
    between = None
    if swapper is not None:
        between = [p.numel() for slot in swapper.slots for p in slot.params]
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in params])
    if swapper is not None:   # put the weights back for the next run
        assert not any(slot.resident for slot in swapper.slots)
        for slot in swapper.slots:
            for p, home in zip(slot.params, slot.home):
                p.data = home.clone()
    return float(loss.detach()), grads, swapper, seen, between


@pytest.mark.parametrize("mode", [False, True, "unsloth"])
def test_swapped_blocks_leave_and_come_back_with_identical_results(flux, mode):
    adapter, inputs = flux
    loss, grads, _, _, _ = _step(adapter, inputs, mode, 0)
    loss_s, grads_s, swapper, seen, between = _step(adapter, inputs, mode, 3)
    assert loss_s == loss
    assert grads.abs().sum() > 0
    torch.testing.assert_close(grads_s, grads, rtol=0, atol=0)
    # the swap happened: every swapped block fetched once for its forward and once for its backward, dropped
    # after each; between uses its frozen weights are empty placeholders
    assert swapper.stats.fetches == 6 and swapper.stats.releases == 6 and swapper.stats.prefetches >= 3
    assert all(not any(r) for r in seen)
    assert between and all(n == 0 for n in between)
    kinds = [k for k, _ in swapper.stats.events]
    assert kinds.count("fetch") == 6 and kinds[0] == "fetch"
    assert [i for k, i in swapper.stats.events if k == "fetch"] == [0, 1, 2, 2, 1, 0]   # forward, then backward
    assert swapper.stats.bytes_in == 2 * sum(slot.nbytes() for slot in swapper.slots)
    # adapters never move (the optimizer steps them in place)
    assert all(not p.requires_grad for slot in swapper.slots for p in slot.params)


def test_too_many_blocks_for_a_stage_names_the_key(flux):
    adapter, _ = flux
    layers = adapter.to_layers()
    blocks = sum(swappable_module(layer) is not None for layer in layers)   # micro Flux: 2 double + 2 single
    stage = SimpleNamespace(forward_funcs=layers, stage_id=1)
    with pytest.raises(ConfigError, match=rf"key 'blocks_to_swap'.*stage 1 holds {blocks} transformer blocks"):
        enable_block_swap(stage, blocks, "cpu")
    assert enable_block_swap(stage, 0, "cpu") is None


def test_config_accepts_blocks_to_swap_for_adapters_only():
    from pipetrain.backend.config import RunConfig
    from pipetrain.backend.config.schema import from_dict

    base = {"output_dir": "o", "dataset": "d.toml", "model": {"type": "flux", "diffusion_model": "m", "vae": "v"}}
    assert from_dict(RunConfig, {**base, "blocks_to_swap": 8, "adapter": {"rank": 4}}).blocks_to_swap == 8
    with pytest.raises(ConfigError, match="key 'blocks_to_swap'.*full fine-tune"):
        from_dict(RunConfig, {**base, "blocks_to_swap": 8})
    with pytest.raises(ConfigError, match="key 'blocks_to_swap'.*0 or more"):
        from_dict(RunConfig, {**base, "blocks_to_swap": -1, "adapter": {"rank": 4}})


@pytest.mark.slow
def test_two_stage_run_with_block_swapping_trains_like_without(micro_flux_files, make_run):
    """2 ranks x 2 stages; bfloat16 LoRA weights stepped by AdamW8bitKahan, so the optimizer runs too."""
    from conftest import train

    common = dict(images=4, stages=2, epochs=1, checkpoint_every_n_epochs=None, eval_before_first_step=False,
                  adapter={"dtype": "bfloat16"}, optimizer={"type": "AdamW8bitKahan", "lr": 5e-3, "min_8bit_size": 16})
    plain = train(make_run(micro_flux_files, name="plain", **common), ranks=2)
    assert plain.returncode == 0, plain.output[-4000:]
    swapped = train(make_run(micro_flux_files, name="swap", blocks_to_swap=1, **common), ranks=2)
    assert swapped.returncode == 0, swapped.output[-4000:]
    assert swapped.events("engine")[0]["blocks_swapped"] == [1, 1]          # one block on each stage
    assert plain.events("engine")[0]["blocks_swapped"] == [0, 0]
    assert len(swapped.losses()) == 4
    assert swapped.losses() == pytest.approx(plain.losses(), rel=1e-6)


@pytest.mark.parametrize("mode", [True, "unsloth"])
def test_two_stages_checkpointed_and_partitioned_by_parameters_train(mode, micro_flux_files, make_run):
    """diffusion-pipe's advice for two GPUs (its main_example with pipeline_stages = 2): activation checkpointing with
    partition_method = 'parameters', whose stage boundary DeepSpeed backpropagates one tuple output at a time."""
    from conftest import train

    run = train(make_run(micro_flux_files, images=2, stages=2, epochs=1, checkpoint_every_n_epochs=None,
                         eval_before_first_step=False, activation_checkpointing=mode,
                         partition_method="parameters"), ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    losses = run.losses()
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses
    assert run.loras()
