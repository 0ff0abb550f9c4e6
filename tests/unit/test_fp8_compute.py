"""``fp8_compute``: frozen LoRA-adapted linears multiply in FP8 (e4m3, row-wise scales). On the CPU the emulated
product (dequantize, multiply in float32) stands in for torch's scaled product; forward and input gradient stay
within FP8's error of bf16, the LoRA still trains through them, nothing FP8 reaches the saved state, and the option
is refused where no FP8 product exists."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipetrain.backend.adapters import injection
from pipetrain.backend.errors import ConfigError
from pipetrain.backend.models import fp8

# e4m3 keeps 3 mantissa bits: one rounding is at most 1/16 relative, about 2.3% RMS on Gaussian data; input and
# weight each rounded once, a product's relative error on random data measures ~3.7%
REL_TOL = 0.06


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _adapted(in_features=256, out_features=512, bias=True, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(in_features, out_features, bias=bias)).to(torch.bfloat16)
    injection.inject(model, injection.AdapterSpec(rank=8, alpha=8.0), ("0",))
    with torch.no_grad():
        model[0].lora_B.weight.normal_(0, 0.02)   # a LoRA that already does something
    return model


def _forward_backward(model, x, grad):
    x = x.clone().requires_grad_(True)
    y = model(x)
    y.backward(grad)
    return y.detach(), x.grad, model[0].lora_A.weight.grad.clone(), model[0].lora_B.weight.grad.clone()


def test_quantize_rows_scales_each_row_to_the_e4m3_range():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [1000.0, 3.0, -7.0]])
    q, scale = fp8.quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 1)
    assert torch.allclose(scale[:, 0], torch.tensor([2.0 / 448, 1e-12 / 448, 1000.0 / 448]))
    assert q.float().abs().amax(dim=1).tolist() == [448.0, 0.0, 448.0]   # each row's largest value maps to e4m3 max
    assert torch.allclose(q.float() * scale, x, rtol=1 / 16)


def test_fp8_forward_and_gradients_match_bf16_within_fp8_error():
    model = _adapted()
    x = torch.randn(3, 40, 256, dtype=torch.bfloat16)
    grad = torch.randn(3, 40, 512, dtype=torch.bfloat16)
    y0, dx0, da0, db0 = _forward_backward(model, x, grad)
    model[0].lora_A.weight.grad = model[0].lora_B.weight.grad = None
    assert fp8.convert(model) == 1
    y1, dx1, da1, db1 = _forward_backward(model, x, grad)
    errors = [_rel(y1, y0), _rel(dx1, dx0), _rel(da1, da0), _rel(db1, db0)]
    assert all(e < REL_TOL for e in errors), errors
    # the LoRA's own products stay exact: its gradient with respect to B sees the same x, so only A's gradient,
    # which flows through no base product either, agrees to bf16's rounding
    assert errors[2] < 0.01 and errors[3] < 0.01, errors
    assert 0.005 < errors[0], errors          # and the base product really went through e4m3


def test_convert_replaces_the_base_weight_in_place_and_skips_unaligned_or_trained_linears():
    model = _adapted()
    odd = nn.Linear(24, 40).to(torch.bfloat16)      # 24 and 40 are not multiples of 16
    model.append(odd)
    injection.inject(model, injection.AdapterSpec(rank=4, alpha=4.0), ("1",))
    keys = set(model.state_dict())
    param, weight = model[0].weight, model[0].weight.detach().clone()
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert fp8.convert(model) == 1
    assert fp8.convert(model) == 0                   # once only
    assert set(model.state_dict()) == keys           # no new saved key: the scales are not persistent
    # the same Parameter (the engine's reference) now holds e4m3, one byte an element: the bf16 copy is gone
    assert model[0].weight is param and param.dtype == torch.float8_e4m3fn and not param.requires_grad
    assert param.untyped_storage().nbytes() == weight.numel()
    assert _rel(fp8.base_weight(model[0]), weight) < REL_TOL   # the weight the product and DoRA see
    assert all(torch.equal(p, trained[n]) for n, p in model.named_parameters() if p.requires_grad)
    assert model[1].weight.dtype == torch.bfloat16 and not getattr(model[1], "fp8_compute", False)
    assert isinstance(model[0], nn.Linear) and type(model[0]).__name__ == "FP8Linear"


def test_dora_reads_the_e4m3_weight_with_its_row_scales():
    """DoRA renormalises the whole adapted weight, so after conversion it must see the FP8 weight times its row
    scales: the output stays within FP8's error of the bf16 one (a weight read without its scales would be off by
    orders of magnitude)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512)).to(torch.bfloat16)
    injection.inject(model, injection.AdapterSpec(rank=8, alpha=8.0, dora=True), ("0",))
    with torch.no_grad():
        model[0].lora_B.weight.normal_(0, 0.02)
    x = torch.randn(2, 30, 256, dtype=torch.bfloat16)
    before = model(x).detach()
    fp8.convert(model)
    assert _rel(model(x).detach(), before) < REL_TOL


def test_fp8_stored_base_weights_are_quantized_from_their_scaled_values():
    """``diffusion_model_dtype = "float8"`` with a scaled-fp8 file: the FP8 copy is made from weight * scale_weight."""
    model = _adapted(bias=False)
    reference = model[0].weight.float().clone()
    scale = reference.abs().max() / 448
    model[0].weight.data = (reference / scale).to(torch.float8_e4m3fn)
    model[0].scale_weight = scale
    fp8.convert(model)
    dequantized = model[0].weight.float() * model[0].weight_scale
    assert _rel(dequantized, reference) < REL_TOL


def test_refused_without_an_fp8_gpu():
    with pytest.raises(ConfigError, match="fp8_compute.*compute capability 9.0 or newer.*the cpu device"):
        fp8.check_device(torch.device("cpu"))


def test_config_refuses_fp8_compute_for_full_finetunes_and_block_swapping():
    from pipetrain.backend.config import RunConfig
    from pipetrain.backend.config.schema import from_dict

    base = {"output_dir": "o", "dataset": "d.toml", "model": {"type": "flux", "diffusion_model": "m", "vae": "v"}}
    assert from_dict(RunConfig, {**base, "adapter": {"rank": 4}, "fp8_compute": True}).fp8_compute is True
    assert from_dict(RunConfig, base).fp8_compute is False
    with pytest.raises(ConfigError, match="fp8_compute.*\\[adapter\\] table"):
        from_dict(RunConfig, {**base, "fp8_compute": True})
    with pytest.raises(ConfigError, match="fp8_compute.*blocks_to_swap = 0"):
        from_dict(RunConfig, {**base, "adapter": {"rank": 4}, "fp8_compute": True, "blocks_to_swap": 2})


def test_memory_node_passes_fp8_compute_to_the_run_config():
    from pipetrain.backend.host.runtime import ensure_comfyui
    ensure_comfyui()
    from pipetrain.nodes.settings import MemoryNode
    from test_options_nodes_memory_adapter import _config

    spec = MemoryNode.execute(False, 0, fp8_compute=True).result[0]
    assert spec.get("fp8_compute") and _config(memory=spec).fp8_compute
    assert not MemoryNode.execute(False, 0).result[0].get("fp8_compute") and not _config().fp8_compute


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < fp8.MIN_CAPABILITY,
                    reason="needs a GPU with FP8 products")
def test_scaled_mm_on_the_gpu_matches_the_emulation():
    torch.manual_seed(0)
    x = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    xq, xs = fp8.quantize_rows(x)
    wq, ws = fp8.quantize_rows(w)
    gpu = fp8.scaled_mm(xq, xs, wq, ws, torch.bfloat16)
    emulated = fp8.scaled_mm(xq.cpu(), xs.cpu(), wq.cpu(), ws.cpu(), torch.float32)
    assert _rel(gpu.cpu(), emulated) < 0.01
    fp8.check_device(torch.device("cuda"))   # accepted
