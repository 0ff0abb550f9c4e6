"""``compile = true``: the compiled block layers (SDXL: the transformer blocks inside them) give the eager layers'
outputs and LoRA gradients, and a new bucket shape costs one recompile, not one per block or per bucket."""
import pytest
import torch
from layer_checks import Patcher, checkpointed_layers, give_lora_b_values, is_down_projection, run_layers, saved_bytes

from pipetrain.backend.adapters import injection
from pipetrain.backend.config import ModelConfig
from pipetrain.backend.models.compiling import compile_blocks
from pipetrain.backend.host.runtime import ensure_comfyui

pytestmark = pytest.mark.slow   # inductor compiles C++ kernels on the CPU: ~1 minute


def _small_flux():
    ensure_comfyui()
    import comfy.ops
    from comfy.ldm.flux.model import Flux
    from pipetrain.backend.models.flux import FluxAdapter

    torch.manual_seed(0)
    dm = Flux(operations=comfy.ops.disable_weight_init, in_channels=16, out_channels=16, vec_in_dim=32,
              context_in_dim=48, hidden_size=64, mlp_ratio=4.0, num_heads=4, depth=2, depth_single_blocks=3,
              axes_dim=[4, 6, 6], theta=10000, patch_size=2, qkv_bias=True, guidance_embed=True)
    for p in dm.parameters():
        torch.nn.init.normal_(p, std=0.08)
    adapter = FluxAdapter(ModelConfig(type="flux", diffusion_model="unused", vae="unused", guidance=3.5))
    adapter.dtype = torch.float32
    adapter.use_model(Patcher(dm))
    injection.inject(dm, injection.AdapterSpec(rank=4, alpha=4.0), adapter.lora_block_prefixes)
    give_lora_b_values(dm)
    return adapter


def _inputs(h, w, seed=1):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(2, 16, h, w, generator=g)
    return (x0, torch.randn(x0.shape, generator=g), torch.tensor([0.25, 0.8]), torch.randn(2, 5, 48, generator=g),
            torch.randn(2, 32, generator=g))


def _loss_and_grads(adapter, layers, inputs):
    params = injection.trainable_parameters(adapter.diffusion_model)
    for p in params:
        p.grad = None
    loss = adapter.loss(run_layers(layers, inputs), inputs[:3])
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in params]


def test_compiled_blocks_match_eager_and_compile_once_per_kind_and_shape_regime():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    adapter = _small_flux()
    eager = adapter.to_layers()
    compiled = checkpointed_layers(adapter, True)
    assert compile_blocks(compiled) == 5            # 2 double + 3 single blocks; embedders stay eager
    counters.clear()
    for h, w in ((6, 10), (8, 8), (4, 12)):        # three buckets
        inputs = _inputs(h, w)
        loss_e, grads_e = _loss_and_grads(adapter, eager, inputs)
        loss_c, grads_c = _loss_and_grads(adapter, compiled, inputs)
        assert torch.allclose(loss_c, loss_e, rtol=1e-5)
        for ge, gc in zip(grads_e, grads_c):
            assert torch.allclose(gc, ge, rtol=1e-4, atol=1e-6), (gc - ge).abs().max()
    # double and single blocks: one static graph each for the first bucket, one dynamic graph each after the
    # second; the third bucket reuses the dynamic graphs
    assert counters["stats"]["unique_graphs"] <= 4, dict(counters["stats"])


def test_compiled_selective_blocks_recompute_neither_attention_nor_down_projections():
    """``'selective'`` compiled with its checkpoint inside the block graph: the eager gradients, and the attention
    kernels and MLP down-projections (inner dimension 4x the output width) run as often in a step as without
    checkpointing, where ``true`` runs them again in the backward."""
    from torch.profiler import profile

    torch._dynamo.reset()
    adapter = _small_flux()
    inputs = _inputs(6, 10)
    loss_e, grads_e = _loss_and_grads(adapter, adapter.to_layers(), inputs)
    runs = {}
    for mode in (False, True, "selective"):
        layers = checkpointed_layers(adapter, mode)
        assert compile_blocks(layers) == 5
        _loss_and_grads(adapter, layers, inputs)           # compiles
        with profile(record_shapes=True) as prof:
            loss_c, grads_c = _loss_and_grads(adapter, layers, inputs)
        events = prof.events()
        attention = sum(e.name == "aten::_scaled_dot_product_flash_attention_for_cpu" for e in events)
        products = sum(is_down_projection(e.name, e.input_shapes) for e in events)
        runs[mode] = (attention, products)
        assert torch.allclose(loss_c, loss_e, rtol=1e-5)
        for ge, gc in zip(grads_e, grads_c):
            assert torch.allclose(gc, ge, rtol=1e-4, atol=1e-6), (gc - ge).abs().max()
    assert runs[False][0] == 5 and runs[True][0] == 10
    assert runs[True][1] >= runs[False][1] + 5
    assert runs["selective"] == runs[False], runs


def _saved_bytes_loss_and_grads(adapter, layers, inputs):
    """What autograd keeps for the backward over one forward, weights left out."""
    with saved_bytes(skip=tuple(adapter.diffusion_model.parameters())) as saved:
        loss, grads = _loss_and_grads(adapter, layers, inputs)
    return sum(saved), loss, grads


def test_an_activation_memory_budget_keeps_fewer_activations_with_the_same_gradients():
    """``activation_memory_budget``: the partitioner keeps at most that share of each compiled block's activations
    and recomputes the rest in the backward; loss and LoRA gradients stay the eager ones."""
    # the bucket the selective test compiles without checkpointing: with no budget, the same graphs, which then come
    # from Inductor's caches (the budget's effect does not depend on the shape)
    inputs = _inputs(6, 10)
    adapter = _small_flux()
    loss_e, grads_e = _loss_and_grads(adapter, adapter.to_layers(), inputs)
    saved = {}
    for budget in (None, 0.5, 0.0):
        torch._dynamo.reset()
        layers = adapter.to_layers()
        assert adapter.compile(layers, memory_budget=budget) == 5
        saved[budget], loss, grads = _saved_bytes_loss_and_grads(adapter, layers, inputs)
        assert torch.allclose(loss, loss_e, rtol=1e-5)
        for ge, gc in zip(grads_e, grads):
            assert torch.allclose(gc, ge, rtol=1e-4, atol=1e-6), (budget, (gc - ge).abs().max())
    assert saved[0.0] < saved[0.5] < saved[None], saved


SDXL_CONTEXT = 64


def _small_sdxl():
    """The tiny SDXL UNet with two transformer blocks per SpatialTransformer (SDXL has 2 and 10), float32."""
    from layer_checks import comfy_model
    from pipetrain.backend.models.sdxl import SDXL_UNET_TINY, SDXLAdapter

    ensure_comfyui()
    config = {**SDXL_UNET_TINY, "context_dim": SDXL_CONTEXT, "transformer_depth": [0, 0, 2, 2, 2, 2],
              "transformer_depth_middle": 2, "transformer_depth_output": [0, 0, 0, 2, 2, 2, 2, 2, 2]}
    adapter = SDXLAdapter(ModelConfig(type="sdxl", diffusion_model="unused", vae="unused"))
    adapter.dtype = torch.float32
    adapter.use_model(comfy_model("sdxl", config, dtype=torch.float32))
    adapter.check_model()
    injection.inject(adapter.diffusion_model, injection.AdapterSpec(rank=4, alpha=4.0), adapter.lora_block_prefixes)
    give_lora_b_values(adapter.diffusion_model)
    return adapter


def _sdxl_inputs(h, w, seed=1):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(2, 4, h, w, generator=g)
    return (x0, torch.randn(x0.shape, generator=g), torch.tensor([10.0, 800.0]),
            torch.randn(2, 7, SDXL_CONTEXT, generator=g), torch.randn(2, 1280, generator=g))


SDXL_BUCKETS = ((8, 8), (6, 10), (4, 12))   # latent sides; the transformers run at 1/2 and 1/4 of them


@pytest.fixture(scope="module")
def sdxl_and_eager():
    """One tiny SDXL for the four checkpointing modes, with its eager loss and LoRA gradients per bucket taken once,
    before anything compiles (compiling patches the model) and without checkpointing: recomputing a forward gives
    the same values, so every mode's compiled blocks are held to the plain eager ones. A mode's compile sets the
    blocks' and norms' compiled forwards afresh (after ``torch._dynamo.reset()``), so the model carries nothing
    compiled from one mode to the next."""
    torch._dynamo.reset()
    adapter = _small_sdxl()
    layers = checkpointed_layers(adapter, False)
    return adapter, [_loss_and_grads(adapter, layers, _sdxl_inputs(h, w)) for h, w in SDXL_BUCKETS]


@pytest.mark.parametrize("checkpointing", [False, True, "unsloth", "selective"])
def test_sdxl_compiles_its_transformer_blocks_once_per_width_and_matches_eager(checkpointing, sdxl_and_eager):
    """SDXL compiles ComfyUI's BasicTransformerBlocks (dynamic shapes) and its GroupNorms, not whole UNet blocks:
    the layers' own checkpoint stays around them, and every block and bucket of one width reuses one graph."""

    torch._dynamo.reset()
    adapter, eager = sdxl_and_eager
    from comfy.ldm.modules.attention import BasicTransformerBlock
    layers = checkpointed_layers(adapter, checkpointing)
    buckets = SDXL_BUCKETS
    blocks = [m for m in adapter.diffusion_model.modules() if isinstance(m, BasicTransformerBlock)]
    assert adapter.compile(layers) == len(blocks) == 22    # 11 SpatialTransformers x 2 (and the GroupNorms)
    assert all(layer.checkpoint_activations == checkpointing for layer in layers[1:-1])
    for (h, w), (loss_e, grads_e) in zip(buckets, eager):
        loss_c, grads_c = _loss_and_grads(adapter, layers, _sdxl_inputs(h, w))
        assert torch.allclose(loss_c, loss_e, rtol=1e-5)
        scale = max(ge.abs().max() for ge in grads_e)   # some LoRA A gradients nearly cancel out: near 0
        for ge, gc in zip(grads_e, grads_c):
            assert torch.allclose(gc, ge, rtol=1e-4, atol=1e-4 * scale), (gc - ge).abs().max()
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list as graphs_of

    from pipetrain.backend.models import compiling, sdxl
    # two widths (64, 128): at most a static and a dynamic graph each, whatever the block or bucket (true and
    # 'unsloth' run the forward without grad and recompute it with grad: graphs of their own for each)
    no_grad_forward = checkpointing in (True, "unsloth")
    blocks = len(graphs_of(compiling._module_forward.__code__))
    assert 2 <= blocks <= (8 if no_grad_forward else 4), blocks
    # GroupNorms: one graph per channel count (parameters have static shapes), with and without the embedding add;
    # the tiny buckets' 1- and 2-wide levels add 0/1 specialisations (a forward without grad: twice). Not one per
    # norm and bucket (17 x 2 + 11 norms, 3 buckets).
    norms = len(graphs_of(sdxl.group_norm.__code__)) + len(graphs_of(sdxl.group_norm_act.__code__))
    assert 3 <= norms <= (48 if no_grad_forward else 24), norms


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_sdxl_blocks_replayed_as_cuda_graphs_train_like_eager_blocks():
    """Four SGD steps with the transformer blocks compiled and replayed as CUDA graphs: the same losses and LoRA
    weights as eager, and no region skipped from graphing."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    adapter = _small_sdxl()
    dm = adapter.diffusion_model.cuda()
    initial = {k: v.clone() for k, v in dm.state_dict().items()}
    layers = adapter.to_layers()
    batches = [tuple(x.cuda() for x in _sdxl_inputs(8, 8, seed=s)) for s in range(4)]

    def train():
        dm.load_state_dict(initial)          # in place: the graphs keep the parameters' addresses
        params = injection.trainable_parameters(dm)
        opt = torch.optim.SGD(params, lr=0.5)
        losses = []
        for batch in batches:
            torch.compiler.cudagraph_mark_step_begin()
            loss = adapter.loss(run_layers(layers, batch), batch[:3])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return torch.tensor(losses), [p.detach().clone() for p in params]

    eager_losses, eager_params = train()
    assert adapter.compile(layers, cuda_graphs=True) == 22
    graphed_losses, graphed_params = train()
    assert torch.allclose(graphed_losses, eager_losses, rtol=1e-4), (graphed_losses, eager_losses)
    assert not torch.equal(eager_params[0], initial_lora_value(initial, dm))    # the steps trained something
    for pe, pg in zip(eager_params, graphed_params):
        assert torch.allclose(pg, pe, rtol=1e-3, atol=1e-6), (pg - pe).abs().max()
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


def initial_lora_value(initial: dict, dm) -> torch.Tensor:
    name = next(n for n, p in dm.named_parameters() if p.requires_grad)
    return initial[name]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's GroupNorm backward is the one that returns NCHW")
@pytest.mark.parametrize("shift", [False, True])
def test_compiled_sdxl_norms_hand_back_channels_last_gradients(shift):
    """CUDA's GroupNorm backward returns an NCHW gradient, which the convolution before the norm copied back to
    channels-last in every backward; the compiled norms hand theirs on in the input's layout."""
    from pipetrain.backend.models.sdxl import Norms

    norms = Norms()
    norms.compile(None)
    norm, act = torch.nn.GroupNorm(32, 64).cuda(), torch.nn.SiLU()
    x = torch.randn(2, 64, 16, 16, device="cuda").contiguous(memory_format=torch.channels_last).requires_grad_()
    y = norms.norm_act(norm, act, x, torch.randn(2, 64, 1, 1, device="cuda") if shift else None)
    y.backward(torch.randn_like(y))
    assert y.is_contiguous(memory_format=torch.channels_last) and x.grad.is_contiguous(memory_format=torch.channels_last)
