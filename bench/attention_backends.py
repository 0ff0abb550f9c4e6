# SPDX-License-Identifier: GPL-3.0-or-later
"""Which scaled-dot-product attention kernel trains fastest at each model's shapes? Forward plus backward of
torch's SDPA in bf16, one backend at a time (FlashAttention-2, memory-efficient, cuDNN, and compiled flex
attention where it builds), at the attention shapes of the models PipeTrain trains on the GPU. Each backend's
output and input gradients are compared with a float32 math-kernel reference on the same inputs; a backend that
is wrong or refuses a shape is reported as such, never timed. Writes ``attention_backends.json``.

    python bench/attention_backends.py --out $OUT
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# name: (batch, heads, query tokens, key tokens, head dim)
SHAPES = {
    "flux-1024": (1, 24, 4608, 4608, 128),          # 4096 image + 512 text tokens, joint attention
    "qwen_image-1024": (1, 24, 4352, 4352, 128),
    "sdxl-1024-b8-self64": (8, 10, 4096, 4096, 64),  # the 64x64 level's self attention
    "sdxl-1024-b8-self32": (8, 20, 1024, 1024, 64),
    "sdxl-1024-b8-cross": (8, 20, 1024, 77, 64),
    "wan14b-480x832x33": (1, 40, 14040, 14040, 128),
}
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION}
TOLERANCE = 2e-2   # relative L2 error of bf16 operands against a float32 reference


def inputs(shape, seed=0):
    b, h, lq, lk, d = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, h, lq, d, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(b, h, lk, d, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(b, h, lk, d, device="cuda", generator=g, dtype=torch.bfloat16)
    grad = torch.randn(b, h, lq, d, device="cuda", generator=g, dtype=torch.bfloat16)
    return q, k, v, grad


def run(attend, q, k, v, grad):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attend(q, k, v)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def rel_error(got, ref) -> float:
    return float((got.float() - ref).norm() / ref.norm())


def reference(q, k, v, grad):
    """float32 on the math kernel, queries in slices so the score matrix fits."""
    with sdpa_kernel([SDPBackend.MATH]):
        return run(lambda *t: F.scaled_dot_product_attention(*(x.float() for x in t)).to(torch.float32),
                   q.float(), k.float(), v.float(), grad.float())


def median_ms(fn, repeats=20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def attenders(flex: bool):
    for name, backend in BACKENDS.items():
        def attend(q, k, v, backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v)
        yield name, attend
    if not flex:   # compiling it costs tens of seconds a shape
        return
    try:
        from torch.nn.attention.flex_attention import flex_attention
        compiled = torch.compile(flex_attention, dynamic=False)
        yield "flex", lambda q, k, v: compiled(q, k, v)
    except ImportError:
        pass


def measure(shape, flex: bool) -> dict:
    q, k, v, grad = inputs(shape)
    small = (1, shape[1], min(shape[2], 2048), min(shape[3], 2048), shape[4])   # the reference's size
    rq, rk, rv, rgrad = (t[:1, :, :small[2]] if i in (0, 3) else t[:1, :, :small[3]]
                         for i, t in enumerate((q, k, v, grad)))
    ref = reference(rq, rk, rv, rgrad)
    row = {}
    for name, attend in attenders(flex):
        try:
            got = run(attend, rq, rk, rv, rgrad)
            errors = [rel_error(g, r) for g, r in zip(got, ref)]
            if not all(e < TOLERANCE for e in errors):
                row[name] = {"wrong": errors}
                continue
            row[name] = {"ms": median_ms(lambda: run(attend, q, k, v, grad)), "max_rel_error": max(errors)}
        except Exception as exc:   # a backend that refuses this shape, dtype or device
            row[name] = {"refused": f"{type(exc).__name__}: {str(exc)[:200]}"}
    timed = {n: r["ms"] for n, r in row.items() if "ms" in r}
    row["fastest"] = min(timed, key=timed.get) if timed else None
    row["default_ms"] = median_ms(lambda: run(F.scaled_dot_product_attention, q, k, v, grad))   # torch's choice
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--flex", default="flux-1024", help="shapes that also time compiled flex attention")
    args = parser.parse_args(argv)
    results = {"torch": torch.__version__, "device": torch.cuda.get_device_name(),
               "cudnn": torch.backends.cudnn.version()}
    for name in args.shapes.split(","):
        results[name] = measure(SHAPES[name], name in args.flex.split(","))
        print(name, json.dumps(results[name]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention_backends.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
