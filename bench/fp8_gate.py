"""FP8 compute's quality gate: the same LoRA training steps (seed, latents, noise, timesteps, initial LoRA) with the
base linears in bf16 and with ``fp8_compute``, on one GPU; the loss curves and the trained LoRAs compared.

    python bench/fp8_gate.py --out $OUT [--arch flux] [--resolution 512] [--steps 200] [--lr 1e-4]

The model is built as ``bench/models.py`` builds it (ComfyUI's class at its published size, random weights), LoRA
rank 32 on the adapter's targets, AdamW, no DeepSpeed: the same layers the trainer runs. The latents are a fixed
set of four (so the LoRA has something to fit), cycled; noise and timesteps come from one seeded generator, the
same in both runs. Figures (``fp8_gate.json``):

- ``loss_rel_diff``: |mean fp8 loss - mean bf16 loss| / mean bf16 loss over all steps, and over the last quarter;
- ``loss_step_rel_diff_median``: the median over steps of |fp8 - bf16| / bf16 (the same noise, step by step);
- ``lora_delta_rel_diff``: ||dW_fp8 - dW_bf16|| / ||dW_bf16|| over every adapted linear (dW = B A alpha/rank);
- ``lora_effect_rel_diff``: the LoRA's effect on the bf16 model's prediction for a held-out input (output with the
  LoRA minus output without), fp8-trained against bf16-trained, relative to the bf16-trained effect.

The gate holds when the loss differences stay under ``--loss-tolerance`` and the effect difference under
``--effect-tolerance``.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

LATENTS = 4


def _loss(layers, inputs, adapter) -> torch.Tensor:
    h = inputs
    for layer in layers:
        h = layer(h)
    return adapter.loss(h, inputs[:3])


def train(layers, adapter, dm, initial: dict, base: tuple, steps: int, lr: float, seed: int) -> tuple[list, dict]:
    from pipetrain.backend.adapters import injection

    injection.load_into(dm, initial)
    opt = torch.optim.AdamW(injection.trainable_parameters(dm), lr=lr)
    x0s, rest = base
    g = torch.Generator(device=x0s.device).manual_seed(seed)
    losses = []
    for i in range(steps):
        x0 = x0s[i % LATENTS:i % LATENTS + 1]
        noise = torch.randn(x0.shape, generator=g, device=x0.device)
        t = torch.rand(1, generator=g, device=x0.device) * 0.98 + 0.01
        loss = _loss(layers, (x0, noise, t, *rest), adapter)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return [float(v) for v in losses], injection.state_dict(dm)


@torch.no_grad()
def prediction(layers, inputs) -> torch.Tensor:
    h = inputs
    for layer in layers:
        h = layer(h)
    return (h[0] if isinstance(h, tuple) else h).float()


def delta_rel_diff(a: dict, b: dict, scale: float, device) -> float:
    """||dW_a - dW_b|| / ||dW_b|| summed over every adapted linear."""
    num = den = 0.0
    for key in a:
        if not key.endswith(".lora_A.weight"):
            continue
        stem = key[: -len(".lora_A.weight")]
        da = (a[f"{stem}.lora_B.weight"].to(device).float() @ a[key].to(device).float()) * scale
        db = (b[f"{stem}.lora_B.weight"].to(device).float() @ b[key].to(device).float()) * scale
        num += float((da - db).pow(2).sum())
        den += float(db.pow(2).sum())
    return (num / den) ** 0.5 if den else float("nan")


# Flux-dev's block linears at 1024² (4096 image + 512 text tokens): (tokens, in, out)
MICRO_SHAPES = [(4608, 3072, 3072), (4608, 3072, 9216), (4608, 3072, 12288), (4608, 12288, 3072),
                (4608, 15360, 3072), (4608, 3072, 21504)]


def micro(repeats: int = 20) -> list[dict]:
    """Forward + input-gradient of one linear, bf16 against FP8 (quantization included), eager and compiled."""
    from pipetrain.backend.models import fp8

    rows = []
    for m, k, n in MICRO_SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        wq, ws = fp8.quantize_rows(w)
        g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        variants = {"bf16": lambda: torch.nn.functional.linear(x, w), "fp8": lambda: fp8.fp8_linear(x, wq, ws)}
        variants["fp8_compiled"] = torch.compile(variants["fp8"])
        row = {"shape": [m, k, n]}
        for name, fn in variants.items():
            for _ in range(3):
                fn().backward(g)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                fn().backward(g)
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / repeats
            row[f"{name}_ms"] = round(ms, 3)
            row[f"{name}_tflops"] = round(4 * m * k * n / ms / 1e9, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    from pipetrain.backend.adapters import injection
    from pipetrain.backend.models import fp8
    from pipetrain.backend.host.runtime import ensure_comfyui
    from pipetrain.bench.models import build, probe_inputs

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="flux")
    p.add_argument("--out", default="bench-out")
    p.add_argument("--size", default="full")
    p.add_argument("--resolution", type=int, default=512)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loss-tolerance", type=float, default=0.01)
    p.add_argument("--effect-tolerance", type=float, default=0.10)
    p.add_argument("--micro", action="store_true", help="first time one linear's forward and input gradient, bf16 "
                   "against FP8, at Flux's shapes (micro.json)")
    args = p.parse_args()
    ensure_comfyui()
    if args.micro:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "micro.json").write_text(json.dumps(micro(), indent=1))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    adapter = build(args.arch, device, dtype, args.size)
    dm = adapter.diffusion_model
    spec = injection.AdapterSpec(rank=32, alpha=32.0)
    injection.inject(dm, spec, adapter.lora_block_prefixes)
    layers = adapter.to_layers()
    initial = injection.state_dict(dm)
    probe = probe_inputs(adapter, args.resolution, 1, device)
    g = torch.Generator().manual_seed(args.seed + 1)
    x0s = torch.randn((LATENTS, *probe[0].shape[1:]), generator=g).to(device)
    base = (x0s, probe[3:])
    held_out = (torch.randn(probe[0].shape, generator=g).to(device), torch.randn(probe[0].shape, generator=g).to(device),
                torch.tensor([0.5], device=device), *probe[3:])

    t = time.monotonic()
    losses_bf16, lora_bf16 = train(layers, adapter, dm, initial, base, args.steps, args.lr, args.seed)
    bf16_s = time.monotonic() - t
    classes = {m: type(m) for m in dm.modules()}
    bf16_weights = {m: m.weight.data for m in dm.modules() if hasattr(m, "lora_name")}   # convert replaces them
    converted = fp8.convert(dm)
    t = time.monotonic()
    losses_fp8, lora_fp8 = train(layers, adapter, dm, initial, base, args.steps, args.lr, args.seed)
    fp8_s = time.monotonic() - t
    for m, cls in classes.items():   # the effect is measured on the bf16 model
        m.__class__ = cls
    for m, weight in bf16_weights.items():
        m.weight.data = weight

    def effect(sd):
        injection.load_into(dm, sd)
        return prediction(layers, held_out)
    zero = {k: torch.zeros_like(v) if k.endswith("lora_B.weight") else v for k, v in initial.items()}
    without = effect(zero)
    eff_bf16, eff_fp8 = effect(lora_bf16) - without, effect(lora_fp8) - without
    mean = lambda v: sum(v) / len(v)   # noqa: E731
    tail = args.steps // 4
    per_step = sorted(abs(a - b) / abs(b) for a, b in zip(losses_fp8, losses_bf16))
    result = {
        "args": vars(args), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "linears_fp8": converted, "bf16_s": round(bf16_s, 1), "fp8_s": round(fp8_s, 1),
        "loss_mean_bf16": mean(losses_bf16), "loss_mean_fp8": mean(losses_fp8),
        "loss_rel_diff": abs(mean(losses_fp8) - mean(losses_bf16)) / mean(losses_bf16),
        "loss_rel_diff_last_quarter": abs(mean(losses_fp8[-tail:]) - mean(losses_bf16[-tail:])) / mean(losses_bf16[-tail:]),
        "loss_step_rel_diff_median": per_step[len(per_step) // 2],
        "lora_delta_rel_diff": delta_rel_diff(lora_fp8, lora_bf16, spec.scale, device),
        "lora_effect_rel_diff": float((eff_fp8 - eff_bf16).norm() / eff_bf16.norm()),
        "lora_effect_rel_to_output": float(eff_bf16.norm() / without.norm()),
        "losses_bf16": losses_bf16, "losses_fp8": losses_fp8,
    }
    result["passed"] = (result["loss_rel_diff"] <= args.loss_tolerance
                        and result["loss_rel_diff_last_quarter"] <= args.loss_tolerance
                        and result["lora_effect_rel_diff"] <= args.effect_tolerance)
    (out / "fp8_gate.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if not k.startswith("losses")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
