"""Memory savers on the micro Flux, in process: ``activation_checkpointing = 'unsloth'`` (block inputs parked in
CPU memory, block recomputed in backward) gives the loss and LoRA gradients of ``true`` and of no
checkpointing, LoRA dropout included (the recompute replays the RNG); so does ``'selective'``, whose recompute
skips the attention kernels and MLP down-projections."""
from __future__ import annotations

import pytest
import torch
from conftest import micro_flux_with_lora
from layer_checks import checkpointed_layers, is_down_projection, saved_bytes
from torch.utils._python_dispatch import TorchDispatchMode

from pipetrain.backend.adapters import injection
from pipetrain.backend.models.checkpointing import ATTENTION_OPS


@pytest.fixture(scope="module")
def flux(micro_flux_files):
    return micro_flux_with_lora(micro_flux_files)


def _step(adapter, inputs, mode):
    x0, noise, t, text = inputs
    layers = checkpointed_layers(adapter, mode)
    torch.manual_seed(11)   # LoRA dropout masks
    h = (x0, noise, t, *text)
    grad_fns = set()
    for layer in layers:
        h = layer(h)
        grad_fns |= {type(x.grad_fn).__name__ for x in (h if isinstance(h, tuple) else (h,)) if x.grad_fn}
    loss = adapter.loss(h, (x0, noise, t))
    params = injection.trainable_parameters(adapter.diffusion_model)
    for p in params:
        p.grad = None
    loss.backward()   # as DeepSpeed does (the offloaded recompute accumulates into .grad, like reentrant checkpoints)
    return float(loss.detach()), torch.cat([p.grad.flatten() for p in params]), grad_fns


def test_unsloth_checkpointing_matches_true_and_no_checkpointing(flux):
    adapter, inputs = flux
    loss_off, grads_off, _ = _step(adapter, inputs, False)
    loss_true, grads_true, _ = _step(adapter, inputs, True)
    loss_u, grads_u, fns = _step(adapter, inputs, "unsloth")
    assert "_RecomputedCheckpointBackward" in fns       # the recomputing Function ran, not torch's checkpoint
    assert grads_u.abs().sum() > 0
    assert loss_u == pytest.approx(loss_true, rel=1e-6) and loss_true == pytest.approx(loss_off, rel=1e-6)
    torch.testing.assert_close(grads_u, grads_true, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grads_u, grads_off, rtol=1e-5, atol=1e-7)


class _CostlyKernelRuns(TorchDispatchMode):
    """Counts, where they really run, SDPA's kernels (whichever backend it picked: ``kernels`` names them) and the
    matrix products with an inner dimension at least 4x their output width (the MLP down-projections in the
    forward): a selective checkpoint's own dispatch mode sits above this one and hands back what it kept in the
    recompute without calling the kernel."""

    def __init__(self):
        super().__init__()
        self.attention = self.products = 0
        self.kernels = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in ATTENTION_OPS:
            self.attention += 1
            self.kernels.add(func.__name__)
        self.products += is_down_projection(f"aten::{func.__name__.split('.')[0]}",
                                            [tuple(a.shape) if torch.is_tensor(a) else () for a in args])
        return func(*args, **(kwargs or {}))


def _selective_runs_as_often_as_no_checkpointing(adapter, inputs) -> set[str]:
    """``'selective'``: the loss and LoRA gradients of ``true`` and of no checkpointing (dropout included), and
    the attention kernels and down-projections run as often as without checkpointing; ``true`` runs them again.
    Returns the attention kernels that ran."""
    runs, results, kernels = {}, {}, {}
    for mode in (False, True, "selective"):
        with _CostlyKernelRuns() as counter:
            results[mode] = _step(adapter, inputs, mode)
        runs[mode], kernels[mode] = (counter.attention, counter.products), counter.kernels
    blocks = sum(1 for layer in checkpointed_layers(adapter, True) if getattr(layer, "checkpoint_activations", False))
    assert runs[False][0] == blocks and runs[True][0] == 2 * blocks
    assert runs[True][1] >= runs[False][1] + blocks      # every block's down-projection, again in the recompute
    assert runs["selective"] == runs[False], runs
    loss_s, grads_s, _ = results["selective"]
    for mode in (False, True):
        assert loss_s == pytest.approx(results[mode][0], rel=1e-6)
        torch.testing.assert_close(grads_s, results[mode][1], rtol=1e-5, atol=1e-7)
    return kernels["selective"]


def test_selective_checkpointing_recomputes_neither_attention_nor_down_projections(flux):
    adapter, inputs = flux
    assert _selective_runs_as_often_as_no_checkpointing(adapter, inputs) == {
        "_scaled_dot_product_flash_attention_for_cpu.default"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="SDPA's CUDA kernels")
def test_selective_checkpointing_keeps_what_the_cuda_attention_kernels_return(micro_flux_files):
    """The same on the GPU, where SDPA runs its flash, memory-efficient or cuDNN kernel: the policy names them."""
    adapter, (x0, noise, t, text) = micro_flux_with_lora(micro_flux_files)
    adapter.diffusion_model.cuda()
    inputs = (x0.cuda(), noise.cuda(), t.cuda(), [x.cuda() for x in text])
    kernels = _selective_runs_as_often_as_no_checkpointing(adapter, inputs)
    assert kernels and not any("cpu" in k for k in kernels), kernels


def test_selective_warns_only_where_its_policy_runs_eagerly():
    from pipetrain.backend.models.checkpointing import selective_advice
    from pipetrain.backend.models.flux import FluxAdapter
    from pipetrain.backend.models.sdxl import SDXLAdapter

    assert selective_advice("selective", compiled_inside=False)
    assert selective_advice("selective", compiled_inside=True) is None
    assert selective_advice(True, compiled_inside=False) is None
    # SDXL compiles the transformer blocks inside its checkpointed UNet blocks: the policy around them stays eager
    assert FluxAdapter.compiles_checkpoints and not SDXLAdapter.compiles_checkpoints


def test_unsloth_is_accepted_in_the_config_and_wrong_values_named():
    from pipetrain.backend.config import RunConfig
    from pipetrain.backend.errors import ConfigError
    from pipetrain.backend.config.schema import from_dict

    base = {"output_dir": "o", "dataset": "d.toml", "model": {"type": "flux", "diffusion_model": "m", "vae": "v"}}
    assert from_dict(RunConfig, {**base, "activation_checkpointing": "unsloth"}).activation_checkpointing == "unsloth"
    assert from_dict(RunConfig, {**base, "activation_checkpointing": True}).activation_checkpointing is True
    assert from_dict(RunConfig, {**base, "activation_checkpointing": "selective"}).activation_checkpointing \
        == "selective"
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        from_dict(RunConfig, {**base, "activation_checkpointing": "offload"})


def _saved_bytes(adapter, inputs, layers) -> tuple[int, torch.Tensor]:
    """Bytes autograd keeps for backward over one forward (what activation checkpointing trades for compute)."""
    x0, noise, t, text = inputs
    params = injection.trainable_parameters(adapter.diffusion_model)
    for p in params:
        p.grad = None
    torch.manual_seed(11)   # LoRA dropout masks
    with saved_bytes() as saved:
        h = (x0, noise, t, *text)
        for layer in layers:
            h = layer(h)
        loss = adapter.loss(h, (x0, noise, t))
    loss.backward()
    return sum(saved), torch.cat([p.grad.flatten() for p in params])


def test_checkpointing_a_share_of_the_blocks_keeps_memory_between_none_and_all_with_equal_gradients(flux):
    from pipetrain.backend.models.checkpointing import thin_checkpointing

    adapter, inputs = flux
    none, grads_none = _saved_bytes(adapter, inputs, adapter.to_layers())
    every, grads_every = _saved_bytes(adapter, inputs, checkpointed_layers(adapter, True))
    layers = checkpointed_layers(adapter, True)
    blocks = sum(1 for layer in layers if getattr(layer, "checkpoint_activations", False))
    assert thin_checkpointing(layers, 0.5) == blocks // 2
    half, grads_half = _saved_bytes(adapter, inputs, layers)
    assert every < half < none, (every, half, none)
    torch.testing.assert_close(grads_half, grads_none, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grads_every, grads_none, rtol=1e-5, atol=1e-7)


def test_checkpointing_is_applied_once_to_the_built_layers(flux):
    """Layers are built without checkpointing; the run's mode reaches every block layer, and only those, through
    ``apply_checkpointing`` (with the fraction, the share it keeps)."""
    from pipetrain.backend.models.checkpointing import CheckpointedLayer, apply_checkpointing

    adapter, _ = flux
    layers = adapter.to_layers()
    blocks = [layer for layer in layers if isinstance(layer, CheckpointedLayer)]
    assert len(blocks) == 4 and not any(layer.checkpoint_activations for layer in blocks)   # 2 double + 2 single
    for mode in (True, "unsloth", "selective"):
        assert apply_checkpointing(layers, mode) == 4
        assert [layer.checkpoint_activations for layer in blocks] == [mode] * 4
        assert not any(hasattr(layer, "checkpoint_activations") for layer in layers if layer not in blocks)
    assert apply_checkpointing(layers, "unsloth", 0.5) == 2
    assert [layer.checkpoint_activations for layer in blocks] == [False, "unsloth", False, "unsloth"]
    assert apply_checkpointing(layers, False) == 0


def test_the_checkpointed_share_is_spread_evenly():
    from pipetrain.backend.models.checkpointing import thin_checkpointing

    class Block:
        checkpoint_activations = True

    for count, fraction, kept in ((57, 1 / 3, 19), (57, 0.5, 28), (57, 1.0, 57), (6, 0.5, 3), (4, 0.1, 0)):
        layers = [object()] + [Block() for _ in range(count)] + [object()]   # embedders / head have no flag
        assert thin_checkpointing(layers, fraction) == kept
        on = [i for i, layer in enumerate(layers[1:-1]) if layer.checkpoint_activations]
        gaps = {b - a for a, b in zip(on, on[1:])}
        assert len(on) == kept and (not gaps or max(gaps) - min(gaps) <= 1), on


def _config_from_memory_node(memory):
    """The RunConfig the launcher writes for a Memory node's spec."""
    from pipetrain.backend.config import RunConfig
    from pipetrain.backend.config.schema import from_dict
    from pipetrain.launcher.build import run_table
    from pipetrain.launcher.forms import model_patch
    from test_options_nodes_memory_adapter import DATA

    from pipetrain.launcher.specs import TrainSpec

    spec = TrainSpec(DATA, model_patch("flux", "/m.safetensors", "/v.safetensors", ("/t.safetensors",)), memory=memory)
    table = run_table(spec, output_dir="/out", dataset="/out/dataset.toml", run_name=None, lora_dir=None)
    return from_dict(RunConfig, table, file="nodes")


def test_the_fraction_is_checked_and_reaches_the_config_from_the_memory_node():
    from pipetrain.backend.config import RunConfig
    from pipetrain.backend.errors import ConfigError
    from pipetrain.backend.config.schema import from_dict
    from pipetrain.launcher.forms import memory_patch

    base = {"output_dir": "o", "dataset": "d.toml", "model": {"type": "flux", "diffusion_model": "m", "vae": "v"}}
    cfg = from_dict(RunConfig, {**base, "activation_checkpointing": True, "activation_checkpointing_fraction": 0.5})
    assert cfg.activation_checkpointing_fraction == 0.5
    for value in (0, 1.5):
        with pytest.raises(ConfigError, match="activation_checkpointing_fraction.*must be in"):
            from_dict(RunConfig, {**base, "activation_checkpointing": True, "activation_checkpointing_fraction": value})
    with pytest.raises(ConfigError, match="needs activation_checkpointing = true"):
        from_dict(RunConfig, {**base, "activation_checkpointing_fraction": 0.5})

    assert _config_from_memory_node(memory_patch(True, checkpoint_fraction=0.25)).activation_checkpointing_fraction \
        == 0.25
    assert _config_from_memory_node(memory_patch(False, checkpoint_fraction=0.25)) \
        .activation_checkpointing_fraction == 1.0      # no checkpointing: nothing to share out


def test_the_activation_memory_budget_is_checked_and_reaches_the_config_from_the_memory_node():
    from pipetrain.backend.config import RunConfig
    from pipetrain.backend.errors import ConfigError
    from pipetrain.backend.config.schema import from_dict
    from pipetrain.backend.host.runtime import ensure_comfyui
    from pipetrain.launcher.forms import memory_patch

    ensure_comfyui()   # the nodes import comfy_api
    from pipetrain.nodes.settings import MemoryNode

    base = {"output_dir": "o", "dataset": "d.toml", "model": {"type": "flux", "diffusion_model": "m", "vae": "v"}}
    assert from_dict(RunConfig, {**base, "compile": True, "activation_memory_budget": 0.4}).activation_memory_budget \
        == 0.4
    assert from_dict(RunConfig, base).activation_memory_budget is None
    for value in (-0.1, 1.5):
        with pytest.raises(ConfigError, match="activation_memory_budget.*must be in"):
            from_dict(RunConfig, {**base, "compile": True, "activation_memory_budget": value})
    with pytest.raises(ConfigError, match="activation_memory_budget.*set compile = true"):
        from_dict(RunConfig, {**base, "activation_memory_budget": 0.4})

    memory = MemoryNode.execute(False, 0, compile=True, memory_budget=0.3).result[0]
    assert _config_from_memory_node(memory).activation_memory_budget == 0.3
    assert _config_from_memory_node(memory_patch(True, compile=True)).activation_memory_budget is None   # 1: off
    no_compile = memory_patch(True, memory_budget=0.3)
    assert _config_from_memory_node(no_compile).activation_memory_budget is None
