# SPDX-License-Identifier: GPL-3.0-or-later
"""Capped races (issue #39): PipeTrain with ``memory = "auto"`` against diffusion-pipe's own low-memory configs, both
trainers in one job under the same GPU memory cap (a 24 GB and a 16 GB card emulated on a larger GPU).

    python bench/capped.py --dp <diffusion-pipe checkout> --races flux-1024,wan14b-480x832x33 --caps 24,16 --out $OUT

The cap is enforced the same way in every process of both trainers: the harness puts a folder holding a
``sitecustomize`` module first on the runs' PYTHONPATH (``cap_site``); in every Python process that initialises CUDA
it calls ``torch.cuda.set_per_process_memory_fraction(cap / the GPU's memory)`` on each GPU at that moment, before
the first allocation, and appends what it set to a log the results quote (``cap_applied``: one line per process).
Peaks: each trainer's ``torch.cuda.max_memory_allocated`` over the timed steps (run.py's and diffusion_pipe.py's own
measure) and nvidia-smi's memory.used for the whole run (device level: CUDA contexts and allocator cache included).

diffusion-pipe runs its example config as it ships (``RACES``' ``dp_example``, read from the checkout), with only the
paths, ``max_steps`` and ``save_every_n_epochs`` changed; where it ships none for the model (Flux), settings are tried
in the order given until one trains (``dp_settings``; the result says which). PipeTrain takes from the same config
what a user would keep — gradient accumulation, LoRA rank and dtype, the optimizer class and its arguments (minus
keys its class lacks), float8 base weights where diffusion-pipe's ``transformer_dtype`` is float8 — and sets
``memory = "auto"`` with ``memory_limit_gib`` at the cap in place of the checkpointing and swap settings.

Both trainers train on the same model files where diffusion-pipe reads ComfyUI's formats (Wan); otherwise PipeTrain
trains first on its files, which are then deleted before diffusion-pipe's are written (Qwen-Image's two formats do
not fit the GPU machine's 64 GiB disk together). ``--no-dp`` runs PipeTrain's side alone (with ``--size tiny``, on
the CPU: the code path, no figures). Writes ``capped.json`` after every run and prints a table.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import re
import time
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

CAP_ENV = "PIPETRAIN_BENCH_CAP_GIB"
CAP_LOG_ENV = "PIPETRAIN_BENCH_CAP_LOG"
CAP_HOOK_NAME = "pipetrain_bench_cap"

# Every process started with this module's folder first on PYTHONPATH runs it at start-up (Python's site module);
# torch is not imported here: the cap is queued when torch.cuda is imported and set when CUDA initialises, so a
# process that never uses the GPU (DeepSpeed's launcher) takes no CUDA context.
SITECUSTOMIZE = '''\
# Written by PipeTrain's bench/capped.py: caps PyTorch's CUDA allocator at PIPETRAIN_BENCH_CAP_GIB on every GPU.
import os
import sys


def _cap():
    import json

    import torch

    cap = float(os.environ["PIPETRAIN_BENCH_CAP_GIB"])
    fractions = []
    for device in range(torch.cuda.device_count()):
        total = torch.cuda.get_device_properties(device).total_memory
        fraction = min(1.0, cap * 2 ** 30 / total)
        torch.cuda.set_per_process_memory_fraction(fraction, device)
        fractions.append(round(fraction, 5))
    log = os.environ.get("PIPETRAIN_BENCH_CAP_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "cap_gib": cap, "fractions": fractions,
                                "argv0": os.path.basename(sys.argv[0] if sys.argv else "")}) + "\\n")


_cap.__name__ = "HOOK_NAME"


class _QueueCapWhenTorchCudaLoads:
    def find_spec(self, name, path, target=None):
        if name != "torch.cuda":
            return None
        import importlib.machinery

        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_queue(module):
            exec_module(module)
            module._lazy_call(_cap)    # runs inside CUDA's lazy initialisation, before any allocation

        spec.loader.exec_module = exec_then_queue
        return spec


def _run_the_next_sitecustomize():
    """The one this module shadows (an image's own), if any."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        candidate = os.path.join(entry or ".", "sitecustomize.py")
        if os.path.abspath(entry or ".") != here and os.path.isfile(candidate):
            with open(candidate) as f:
                exec(compile(f.read(), candidate, "exec"), {"__name__": "sitecustomize", "__file__": candidate})
            return


if os.environ.get("PIPETRAIN_BENCH_CAP_GIB"):
    sys.meta_path.insert(0, _QueueCapWhenTorchCudaLoads())
_run_the_next_sitecustomize()
'''.replace("HOOK_NAME", CAP_HOOK_NAME)


def cap_site(folder: Path) -> Path:
    """The folder holding the cap's ``sitecustomize.py``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return folder


def cap_env(site: Path, cap_gib: float, log: Path) -> dict:
    """The environment a capped run adds to the harness's own."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
            CAP_ENV: f"{cap_gib:g}", CAP_LOG_ENV: str(log)}


def cap_applied(log: Path) -> list[dict]:
    return [json.loads(x) for x in log.read_text().splitlines() if x.strip()] if log.exists() else []


@dataclass(frozen=True)
class Race:
    case: str                        # the run.py / diffusion_pipe.py case: model files, dataset, resolution, frames
    dp_example: str | None = None    # diffusion-pipe's own config for it, a path in its checkout, taken as it ships
    dp_settings: tuple = ()          # without an example: settings over DP_DEFAULTS, tried in order until one trains
    shares_files: bool = False       # PipeTrain trains on diffusion-pipe's files (ComfyUI formats)


# diffusion_pipe.py's settings for the cases it runs without an example (adapter and optimizer as write_configs)
DP_DEFAULTS = {"gradient_accumulation_steps": 1, "activation_checkpointing": True,
               "adapter": {"type": "lora", "rank": 32, "dtype": "bfloat16"},
               "optimizer": {"type": "adamw", "lr": 1e-4, "betas": [0.9, 0.99], "weight_decay": 0.01, "eps": 1e-8}}

RACES = {
    "qwen_image-1024": Race("qwen_image-1024-ckpt", "examples/qwen_image_24gb_vram.toml"),
    "wan14b-480x832x33": Race("wan14b-480x832x33-ckpt", "examples/wan_14b_min_vram.toml", shares_files=True),
    # diffusion-pipe ships no low-memory Flux config: float8 base weights (11 GiB instead of 22 in bf16) with every
    # block checkpointed fits 24 GB and, just, 16; block swapping only where that runs out
    "flux-1024": Race("flux-1024-ckpt", dp_settings=(
        {"model": {"transformer_dtype": "float8"}},
        {"model": {"transformer_dtype": "float8"}, "activation_checkpointing": "unsloth", "blocks_to_swap": 12})),
}
OURS_OPTIMIZER_DROPS = {"adamw8bitkahan": ("stabilize",)}   # diffusion-pipe's own keys our class of that name lacks


def merged(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def dp_settings(race: Race, dp: Path | None) -> list[dict]:
    """The diffusion-pipe configs the race tries, in order: its example as shipped, or DP_DEFAULTS with each of
    ``dp_settings`` over it."""
    if race.dp_example:
        if dp is None:
            raise ValueError(f"{race.case}: needs a diffusion-pipe checkout for {race.dp_example}")
        return [tomllib.loads((dp / race.dp_example).read_text())]
    return [merged(DP_DEFAULTS, s) for s in race.dp_settings] or [copy.deepcopy(DP_DEFAULTS)]


def dp_config(chosen: dict, written: dict) -> dict:
    """diffusion-pipe's main config for the run: ``chosen`` with only what must change for this machine and a timed
    run taken from ``written`` (diffusion_pipe.py's own config for the case): the output and dataset paths, every
    ``*_path`` of [model] (the written files), ``max_steps``, ``epochs`` and ``save_every_n_epochs`` (no save in a
    timed step)."""
    config = copy.deepcopy(chosen)
    for key in ("output_dir", "dataset", "max_steps", "epochs", "save_every_n_epochs"):
        config[key] = written[key]
    model = config.setdefault("model", {})
    for key, value in written["model"].items():
        if key.endswith("_path") or key not in model:
            model[key] = value
    return config


def ours_keys(chosen: dict, cap_gib: float) -> dict:
    """PipeTrain's run keys for a race against diffusion-pipe's ``chosen`` config: what a user keeps from it, and
    ``memory = "auto"`` at the cap for its checkpointing and swap settings."""
    optimizer = dict(chosen["optimizer"])
    for key in OURS_OPTIMIZER_DROPS.get(optimizer["type"].lower(), ()):
        optimizer.pop(key, None)
    adapter = chosen.get("adapter", {})
    keys = {"gradient_accumulation_steps": chosen.get("gradient_accumulation_steps", 1),
            "gradient_clipping": chosen.get("gradient_clipping", 1.0),
            "memory": "auto", "memory_limit_gib": cap_gib, "optimizer": optimizer,
            "adapter": {"rank": adapter.get("rank", 32), "alpha": float(adapter.get("rank", 32)),
                        "dtype": adapter.get("dtype", "bfloat16")}}
    weights = chosen.get("model", {}).get("transformer_dtype")
    if weights and weights.startswith("float8"):
        keys["model"] = {"diffusion_model_dtype": weights}
    return keys


def set_ours(config: Path, keys: dict) -> dict:
    """Rewrite run.py's run.toml with ``keys`` (run.py's checkpointing keys go: ``auto`` picks them)."""
    import tomli_w

    run = tomllib.loads(config.read_text())
    for key in ("activation_checkpointing", "activation_checkpointing_fraction"):
        run.pop(key, None)
    run = merged(run, keys)
    run["optimizer"] = keys["optimizer"]   # the optimizer's arguments as given, none of run.py's left over
    config.write_text(tomli_w.dumps(run))
    return keys


def set_dp(run_dir: Path, chosen: dict, samples: int, shipped: bool) -> dict:
    """Rewrite diffusion_pipe.py's configs in ``run_dir`` for ``chosen``: a shipped example as ``dp_config`` says,
    other settings over diffusion_pipe.py's own config. The dataset repeats its pictures for ``samples`` samples in
    one epoch (no epoch boundary inside the timed steps)."""
    import tomli_w

    written = tomllib.loads((run_dir / "main.toml").read_text())
    main = dp_config(chosen, written) if shipped else merged(written, chosen)
    (run_dir / "main.toml").write_text(tomli_w.dumps(main))
    dataset = run_dir / "dataset.toml"
    count = sum(1 for p in Path(tomllib.loads(dataset.read_text())["directory"][0]["path"]).iterdir()
                if p.suffix != ".txt")
    dataset.write_text(re.sub(r"num_repeats = \d+", f"num_repeats = {-(-samples // count)}", dataset.read_text()))
    return {k: main[k] for k in main if k not in ("output_dir", "dataset")}


def trained(result: dict) -> bool:
    return result.get("rc") == 0 and bool(result.get("samples_per_s"))


def run_race(name: str, race: Race, caps: list[float], args, deadline: float, results: dict, save) -> None:
    from pipetrain.bench.diffusion_pipe import SmiPeak
    from pipetrain.bench.diffusion_pipe_models import model_folder, pipetrain_files
    from pipetrain.bench.run import CASES, free_disk_for, models_name, run_ours, write_models

    root, comfyui, dp = Path(args.work), Path(args.comfyui), Path(args.dp).resolve() if args.dp else None
    case = CASES[race.case]
    frames = args.frames if args.frames and case.frames > 1 else None
    candidates = dp_settings(race, dp)
    ga = candidates[0].get("gradient_accumulation_steps", 1)
    timed = replace(case, gradient_accumulation=ga)
    site = cap_site(root / "cap-site")
    entry = results.setdefault(name, {"case": race.case, "dp_example": race.dp_example, "runs": {}})

    def capped(label: str, cap: float, run) -> dict:
        if time.monotonic() > deadline:
            return {"rc": None, "skipped": "out of time (--deadline-s)"}
        log = root / f"{name}-{label}-cap{cap:g}.caplog"
        log.unlink(missing_ok=True)
        smi = SmiPeak()
        smi.start()
        r = run(cap_env(site, cap, log))
        smi.stop.set()
        return {**r, "smi_peak_gib": smi.peak_mib / 1024 if smi.peak_mib else None, "cap_applied": cap_applied(log)}

    def dp_files() -> dict:
        from pipetrain.bench.diffusion_pipe import write_in_child

        free_disk_for(root, (model_folder(case.arch, root, args.size, case.variant).name,
                             models_name(case, args.size)) if race.shares_files else
                      model_folder(case.arch, root, args.size, case.variant).name)
        written = write_in_child(race.case, root, comfyui, args.size, args.steps, args.resolution, frames)
        if written.returncode != 0:
            raise RuntimeError(f"{race.case}: writing diffusion-pipe's model files failed:\n{written.stderr[-3000:]}")
        return pipetrain_files(model_folder(case.arch, root, args.size, case.variant)) or {}

    t = time.monotonic()
    if race.shares_files and not args.no_dp:
        files = dp_files()
    else:
        free_disk_for(root, models_name(case, args.size))
        files = write_models(case, root, args.size)
        _release_cuda_cache()
    entry["write_s"] = round(time.monotonic() - t, 1)
    for cap in caps:
        keys = ours_keys(candidates[0], cap)
        entry["runs"].setdefault(f"{cap:g}", {})["ours"] = capped("ours", cap, lambda env, keys=keys: run_ours(
            f"{name}-cap{cap:g}", timed, files, root / "pipetrain", args.steps, args.warmup, timeout_s=args.timeout_s,
            env=env, adjust=lambda config: set_ours(config, keys), resolution=args.resolution, frames=frames))
        save()
    if args.no_dp:
        return
    if not race.shares_files:
        t = time.monotonic()
        dp_files()
        entry["dp_write_s"] = round(time.monotonic() - t, 1)
    from pipetrain.bench.diffusion_pipe import run_case

    for cap in caps:
        tries = []
        for chosen in candidates:
            samples = (args.steps + 1) * case.batch * chosen.get("gradient_accumulation_steps", 1)
            r = capped("dp", cap, lambda env, chosen=chosen, samples=samples: run_case(
                race.case, replace(case, gradient_accumulation=chosen.get("gradient_accumulation_steps", 1)), dp,
                root, comfyui, args.size, args.steps, args.warmup, args.resolution, args.timeout_s, frames, env=env,
                adjust=lambda run_dir: set_dp(run_dir, chosen, samples, bool(race.dp_example))))
            tries.append(r)
            if trained(r) or r.get("skipped"):
                break
        entry["runs"][f"{cap:g}"]["diffusion_pipe"] = tries[-1]
        if len(tries) > 1:
            entry["runs"][f"{cap:g}"]["diffusion_pipe_failed_first"] = [
                {"settings": x.get("settings"), "rc": x.get("rc"), "log_tail": (x.get("log_tail") or "")[-800:]}
                for x in tries[:-1]]
        save()


def _release_cuda_cache() -> None:
    """The harness wrote the models on the GPU: hand its cached blocks back before the capped runs start."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def table(results: dict) -> str:
    rows = [f"{'race':20s} {'cap':>4s} {'ours s/s':>8s} {'peak':>6s} {'smi':>6s} {'dp s/s':>7s} {'peak':>6s} "
            f"{'smi':>6s} {'ours/dp':>7s}  ours chose"]
    for name, entry in results.items():
        for cap, r in entry["runs"].items():
            ours, dp = r.get("ours") or {}, r.get("diffusion_pipe") or {}
            a, b = ours.get("samples_per_s"), dp.get("samples_per_s")
            chosen = (ours.get("memory_plan") or {}).get("chosen") or {}
            rows.append(f"{name:20s} {cap:>4s} {_f(a):>8s} {_f(ours.get('peak_gib')):>6s} "
                        f"{_f(ours.get('smi_peak_gib')):>6s} {_f(b):>7s} {_f(dp.get('peak_gib')):>6s} "
                        f"{_f(dp.get('smi_peak_gib')):>6s} {_f(a / b if a and b else None):>7s}  "
                        f"{ {k: v for k, v in chosen.items() if v} if chosen else ours.get('rc')}")
    return "\n".join(rows)


def _f(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dp", help="diffusion-pipe source checkout (its examples/ too)")
    p.add_argument("--races", default=",".join(RACES))
    p.add_argument("--caps", default="24,16", help="GiB, comma-separated")
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--work", default="/tmp/pipetrain-capped")
    p.add_argument("--comfyui", default=os.environ.get("COMFYUI_PATH"))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--size", default="full")
    p.add_argument("--resolution", type=int)
    p.add_argument("--frames", type=int)
    p.add_argument("--timeout-s", type=float, default=300)
    p.add_argument("--deadline-s", type=float, default=1e9, help="start no run after this many seconds")
    p.add_argument("--no-dp", action="store_true", help="PipeTrain's side alone (--size tiny: a CPU check)")
    args = p.parse_args()
    if not args.no_dp and not args.dp:
        p.error("--dp CHECKOUT is needed (or --no-dp)")
    if args.comfyui is None:
        from pipetrain.backend.host.runtime import ensure_comfyui
        args.comfyui = str(ensure_comfyui())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.deadline_s
    results: dict = {}

    def save() -> None:
        (out / "capped.json").write_text(json.dumps(results, indent=1))

    caps = [float(c) for c in args.caps.split(",")]
    for name in args.races.split(","):
        if name not in RACES:
            p.error(f"--races: {name!r} is not one of {', '.join(RACES)}")
        try:
            run_race(name, RACES[name], caps, args, deadline, results, save)
        except RuntimeError as exc:    # the next race still runs
            results.setdefault(name, {"runs": {}})["error"] = str(exc)
        save()
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
