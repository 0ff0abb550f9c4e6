"""``fp8_compute``: the frozen base linears of a LoRA run multiply in FP8 (e4m3) on GPUs that have FP8 tensor cores.

A LoRA run never changes the base weights, so each adapted linear's weight is quantized once, per output row, and
the e4m3 copy takes the weight's place (``weight``, with ``weight_scale`` as a non-persistent buffer): the base
then costs one byte a parameter instead of two, and nothing FP8 reaches a saved file (frozen weights are never
saved). Each forward
quantizes its input per row and calls torch's row-wise scaled matrix product (``torch._scaled_mm``, bf16 out);
the backward quantizes the output gradient per row (the weight's row scales folded in first) and multiplies it by
the same FP8 weight, transposed in memory (the product wants its second operand column-major). No weight
gradient is made: the base is frozen. The LoRA hook (``adapters/injection.py``), biases and everything trained stay in
their own dtypes, so only the base products lose precision; the quality gate in ``bench/fp8_gate.py`` measures how much.

Where no FP8 product exists (the CPU, older GPUs) the same quantization runs emulated — dequantize, multiply in
float32 — which is what the tests compare against bf16; training refuses the option there (``check_device``).
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)
MIN_AMAX = 1e-12      # an all-zero row gets a tiny scale, not a division by zero
ALIGN = 16            # FP8 products need both weight dimensions to be multiples of 16
MIN_CAPABILITY = (9, 0)   # torch's row-wise scaled product runs on Hopper and newer


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (2-D) as e4m3 with one float32 scale per row: ``x ≈ q * scale``."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=MIN_AMAX)
    scale = amax / E4M3_MAX
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def scaled_mm(a: torch.Tensor, a_scale: torch.Tensor, b_t: torch.Tensor, b_scale: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """``(a * a_scale) @ (b_t * b_scale).T`` for e4m3 ``a`` (M, K) and ``b_t`` (N, K), row scales (M, 1) and
    (N, 1): torch's scaled product on a CUDA device, dequantized float32 elsewhere (the emulation)."""
    if a.is_cuda:
        return torch._scaled_mm(a, b_t.t(), scale_a=a_scale, scale_b=b_scale.view(1, -1), out_dtype=out_dtype,
                                use_fast_accum=True)
    return ((a.float() * a_scale) @ (b_t.float() * b_scale).t()).to(out_dtype)


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight_fp8, weight_scale):
        rows = x.reshape(-1, x.shape[-1])
        q, scale = quantize_rows(rows)
        out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float32) else torch.bfloat16
        y = scaled_mm(q, scale, weight_fp8, weight_scale, torch.bfloat16 if x.is_cuda else out_dtype)
        ctx.save_for_backward(weight_fp8, weight_scale)
        ctx.x_dtype = x.dtype
        return y.to(x.dtype).view(*x.shape[:-1], weight_fp8.shape[0])

    @staticmethod
    def backward(ctx, grad):
        weight_fp8, weight_scale = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1]).float() * weight_scale.view(1, -1)   # W = Wq * s, s per out row
        q, scale = quantize_rows(rows)
        ones = torch.ones(weight_fp8.shape[1], 1, device=grad.device, dtype=torch.float32)
        dx = scaled_mm(q, scale, weight_fp8.t().contiguous(), ones, torch.bfloat16 if grad.is_cuda else ctx.x_dtype)
        return dx.to(ctx.x_dtype).view(*grad.shape[:-1], weight_fp8.shape[1]), None, None


def fp8_linear(x: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    y = _FP8Linear.apply(x, weight_fp8, weight_scale)
    return y if bias is None else y + bias.to(y.dtype)


def _forward(self, x):
    return fp8_linear(x, self.weight, self.weight_scale, self.bias)


_CLASSES: dict[type, type] = {}


def _fp8_class(cls: type) -> type:
    """A subclass of the linear's own class (ComfyUI's ops classes included) whose forward is the FP8 one: a
    class, not a per-instance forward, so torch.compile sees one code object for every converted linear."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"FP8{cls.__name__}", (cls,), {"forward": _forward, "fp8_compute": True})
    return _CLASSES[cls]


def base_weight(linear: nn.Linear) -> torch.Tensor:
    """The weight the linear multiplies by: an FP8-computing linear's e4m3 weight times its row scales, fp8-stored
    weights (``diffusion_model_dtype = "float8"``) times their ``scale_weight`` where a scaled-fp8 file gave one."""
    w = linear.weight.detach().float()
    if getattr(linear, "fp8_compute", False):
        return w * linear.weight_scale.float()
    scale = getattr(linear, "scale_weight", None)
    return w * scale.float().to(w.device) if scale is not None else w


def convertible(linear: nn.Linear) -> bool:
    return (not linear.weight.requires_grad and linear.weight.ndim == 2
            and all(d % ALIGN == 0 for d in linear.weight.shape))


def convert(model: nn.Module) -> int:
    """Quantize the weight of every frozen LoRA-adapted linear of ``model`` to e4m3 in place and give it the FP8
    forward; returns how many. Linears whose sizes FP8 products cannot take stay as they are."""
    count = 0
    for module in model.modules():
        if not hasattr(module, "lora_name") or getattr(module, "fp8_compute", False) or not convertible(module):
            continue
        with torch.no_grad():
            q, scale = quantize_rows(base_weight(module))
        # ``.data``, not a new Parameter: whoever holds the Parameter (DeepSpeed's engine) sees the FP8 weight, and
        # the bf16 storage is freed here, one linear at a time, so converting never holds two copies of the model
        module.weight.data = q
        module.register_buffer("weight_scale", scale, persistent=False)
        module.__class__ = _fp8_class(type(module))
        count += 1
    return count


def check_device(device: torch.device, file=None) -> None:
    """Refuse ``fp8_compute`` where no FP8 matrix product exists, before any weight is converted."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if capability is None or capability < MIN_CAPABILITY:
        where = f"compute capability {capability[0]}.{capability[1]}" if capability else f"the {device.type} device"
        raise ConfigError(f"FP8 compute needs an NVIDIA GPU of compute capability {MIN_CAPABILITY[0]}.0 or newer "
                          f"(Hopper, Blackwell); this rank trains on {where}. Set fp8_compute = false",
                          file=file, key="fp8_compute")
