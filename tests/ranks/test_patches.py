"""The patches of ComfyUI (backend/host/patches_comfyui.py) and DeepSpeed (backend/train/patches_deepspeed.py): each
applies to the pinned host and does what it replaces it for, and each refuses, naming the host's version and the
attribute, where what it replaces is missing or takes other arguments."""
from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from pipetrain.backend.host import patches_comfyui
from pipetrain.backend.train import patches_deepspeed
from pipetrain.backend.errors import RuntimeSetupError
from pipetrain.backend.process.command_lines import free_port
from pipetrain.backend.host.runtime import PINNED_VERSION, ensure_comfyui


# --- ComfyUI -------------------------------------------------------------------------------------
def test_forwards_are_rebound_only_onto_the_signature_they_were_written_for():
    ensure_comfyui()
    import comfy.ops
    from comfy.ldm.modules.diffusionmodules.openaimodel import ResBlock

    def res_forward(rb, scale, x, emb):        # ResBlock.forward(self, x, emb) with one bound argument
        return x * scale

    block = ResBlock(32, 32, 0.0, out_channels=32, device="meta",
                     operations=comfy.ops.disable_weight_init)
    assert patches_comfyui.rebind_forwards([block], {ResBlock: res_forward}, 3.0) == 1
    assert float(block(torch.ones(1), None)) == 3.0

    def stale_forward(rb, scale, x, emb, context):   # written for a ResBlock that took a context
        return x
    with pytest.raises(RuntimeSetupError, match=rf"ComfyUI {PINNED_VERSION}: .*ResBlock\.forward takes \(self, "
                                                r"x, emb\), PipeTrain's replacement was written for \(self, x, emb, "
                                                r"context\)"):
        patches_comfyui.rebind_forwards([block], {ResBlock: stale_forward}, 3.0)


def test_flux2s_tokenizer_loader_is_replaced_under_transformers_5_and_adds_the_start_token():
    ensure_comfyui()
    import comfy.text_encoders.flux as comfy_flux
    import transformers

    from pipetrain.backend.models.tiny_tokenizers import MISTRAL_SPECIALS, mistral_tiny_tekken

    ours = patches_comfyui.mistral_tokenizer_for_transformers5()
    assert ours == transformers.__version__.startswith("5")
    if not ours:
        pytest.skip("transformers 4: ComfyUI's own loader works")
    assert comfy_flux.load_mistral_tokenizer is patches_comfyui._load_mistral_tokenizer
    assert patches_comfyui.mistral_tokenizer_for_transformers5()      # a second call finds it in place
    tokenizer = comfy_flux.load_mistral_tokenizer(mistral_tiny_tekken())["tokenizer_object"]
    ids = tokenizer.encode("hi").ids
    assert ids[0] == 1 and ids[1:] == [len(MISTRAL_SPECIALS) + b for b in b"hi"]   # <s>, then the two bytes


def test_a_narrowed_class_takes_the_widths_inside_and_is_itself_again_after():
    ensure_comfyui()
    import comfy.sd
    from comfy.ldm.models.autoencoder import AutoencoderKL

    from pipetrain.backend.models.vaes import KL_DDCONFIG

    narrow = {"ddconfig": {**KL_DDCONFIG, "ch": 32, "num_res_blocks": 1}}
    with patches_comfyui.narrowed_class("comfy.sd:AutoencoderKL", narrow), torch.device("meta"):
        vae = comfy.sd.AutoencoderKL(ddconfig=KL_DDCONFIG, embed_dim=4)
    assert vae.encoder.conv_in.out_channels == 32 and len(vae.encoder.down[0].block) == 1
    assert comfy.sd.AutoencoderKL is AutoencoderKL
    with pytest.raises(RuntimeSetupError, match=rf"ComfyUI {PINNED_VERSION}: comfy.sd.NoSuchVAE does not exist"):
        with patches_comfyui.narrowed_class("comfy.sd:NoSuchVAE", {}):
            pass


# --- DeepSpeed -----------------------------------------------------------------------------------
def _bare_engine():
    """A pipeline engine object without DeepSpeed's set-up (no process group): the patches replace its methods."""
    from deepspeed.runtime.pipe.engine import PipelineEngine
    return PipelineEngine.__new__(PipelineEngine)


def test_only_the_trained_gradients_are_cleared_and_clipping_runs_ours():
    import deepspeed
    engine = _bare_engine()
    trained, frozen = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    trained.grad, frozen.grad = torch.ones(2), torch.ones(2)
    patches_deepspeed.clear_trained_grads_only(engine, [trained])
    engine.zero_grad()
    assert trained.grad is None and frozen.grad is not None
    calls = []
    patches_deepspeed.clip_gradients_with(engine, lambda: calls.append("clipped"))
    engine.clip_fp32_gradients()
    assert calls == ["clipped"]
    with pytest.raises(RuntimeSetupError, match=rf"DeepSpeed {deepspeed.__version__}: "
                                                r".*pipeline_enable_backward_allreduce does not exist"):
        patches_deepspeed.skip_single_rank_allreduce(engine)     # PipelineEngine.__init__ never ran
    engine.pipeline_enable_backward_allreduce = True
    patches_deepspeed.skip_single_rank_allreduce(engine)
    assert engine.pipeline_enable_backward_allreduce is False


def test_an_engine_whose_methods_changed_is_refused():
    class Engine:
        def zero_grad(self, set_to_none=True):
            pass

    with pytest.raises(RuntimeSetupError, match=r"Engine\.zero_grad takes \(self, set_to_none\), PipeTrain's "
                                                r"replacement was written for \(self\).*install the DeepSpeed version"):
        patches_deepspeed.clear_trained_grads_only(Engine(), [])


COSTS = [0.1, 1.0, 1.0, 1.0, 0.1]


def _stages_on_two_ranks(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    from pipetrain.backend.train import distributed
    from pipetrain.backend.train.pipeline import StagedModule

    distributed.init()
    layers = [torch.nn.Linear(2, 2) for _ in range(5)]
    manual = StagedModule(layers, [1.0] * 5, 2, "manual", [1], loss_fn=None)
    compute = StagedModule(layers, COSTS, 2, "compute", None, loss_fn=None)
    results[rank] = (manual.parts, manual._local_start, manual._local_stop, compute.parts, compute._local_start)
    torch.distributed.destroy_process_group()


def test_stages_are_cut_where_the_method_says_on_real_ranks():
    from pipetrain.backend.train.pipeline import stage_bounds

    port = free_port()
    results = mp.Manager().dict()
    mp.spawn(_stages_on_two_ranks, args=(port, results), nprocs=2)
    bounds = stage_bounds(COSTS, 2)
    assert bounds in ([0, 2, 5], [0, 3, 5])      # the heavy middle split as evenly as whole layers allow
    assert results[0] == ([0, 1, 5], 0, 1, bounds, 0)
    assert results[1] == ([0, 1, 5], 1, 5, bounds, bounds[1])
