"""Does one GEMM on the concatenated weight [W; A] beat the base product plus the LoRA down-projection? One linear
with LoRA rank 32 at Flux-dev's 1024² shapes, forward and backward (input gradient and the LoRA's gradients),
compiled, bf16: the way ``adapters/injection.py`` runs it (two products in the forward, three in the backward) against
the fused way (one product [W; A] in the forward; in the backward one product [dY, dH] @ [W; A] for the input gradient).
Prints milliseconds and CUDA kernel launches per call and writes ``lora_fusion.json``.

    python bench/lora_fusion.py --out $OUT
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.nn import functional as F

RANK = 32
# (tokens, in, out) of Flux-dev's block linears at 1024² (4096 image + 512 text tokens)
SHAPES = [(4608, 3072, 3072), (4608, 3072, 9216), (4608, 3072, 12288), (4608, 12288, 3072), (4608, 15360, 3072),
          (4608, 3072, 21504)]


class _FusedDown(torch.autograd.Function):
    """``x @ [W; A].T`` split into the base output and the LoRA's hidden ``x @ A.T``; ``a`` is a view of the
    buffer's last rows (the trained parameter), passed apart so its gradient needs no full-size zeros."""

    @staticmethod
    def forward(ctx, x, wa, a):
        n = wa.shape[0] - a.shape[0]
        y = x @ wa.t()
        ctx.save_for_backward(x, wa)
        ctx.n = n
        return y[:, :n], y[:, n:]

    @staticmethod
    def backward(ctx, gy, gh):
        x, wa = ctx.saved_tensors
        dx = torch.cat([gy, gh], dim=1) @ wa
        return dx, None, gh.t() @ x


def separate(x, w, a, b):
    return F.linear(x, w) + F.linear(F.linear(x, a), b)


def fused(x, wa, a, b):
    y, h = _FusedDown.apply(x, wa, a)
    return y + F.linear(h, b)


def time_it(fn, args, grad, repeats=20) -> tuple[float, int]:
    for _ in range(3):
        fn(*args).backward(grad)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn(*args).backward(grad)
        torch.cuda.synchronize()
    kernels = sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn(*args).backward(grad)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats, kernels


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench-out")
    args = p.parse_args()
    rows = []
    for m, k, n in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        wa = torch.randn(n + RANK, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        w = wa[:n]
        a = torch.nn.Parameter(wa[n:])
        b = torch.nn.Parameter(torch.randn(n, RANK, device="cuda", dtype=torch.bfloat16) * 0.01)
        grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        row = {"shape": [m, k, n]}
        for name, fn, fargs in (("separate", torch.compile(separate), (x, w, a, b)),
                                ("fused", torch.compile(fused), (x, wa, a, b))):
            ms, kernels = time_it(fn, fargs, grad)
            row[f"{name}_ms"], row[f"{name}_kernels"] = round(ms, 3), kernels
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lora_fusion.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
