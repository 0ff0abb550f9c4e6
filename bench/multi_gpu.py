"""Several GPUs for real (issue #23): NCCL pipeline stages and data parallelism, measured in one command.

    python bench/multi_gpu.py --out $OUT [--gpus N] [--budget-s 540] [--cases NAME,...] [--heavy flux2,wan14b]

N is ``torch.cuda.device_count()`` unless ``--gpus`` says otherwise. The cases, in order of value (a case needing more
GPUs than N is recorded as skipped; none starts once less of ``--budget-s`` is left than its estimate):

1. Equivalence, through the training CLI as ``tests/ranks/test_train_equivalence.py`` runs it on CPU ranks (the micro
   Flux, bfloat16 on GPUs, SGD, the same seed, data and noise): ``equiv-stages`` trains 2 pipeline stages on 2 GPUs
   and 1 stage on 1 GPU, ``equiv-dp`` data parallel 2x1 (2 ranks, micro-batch 1) and gradient accumulation 1x2 (1
   rank, 2 micro-batches). Each reports the largest difference of a step's loss (absolute and relative) and of the
   saved LoRA (absolute, and relative to the tensor's largest value, the largest over tensors) against the stated
   tolerance: on GPUs in bfloat16, 1e-2 on the loss and 2e-2 on the LoRA (bfloat16 keeps 8 significant bits, one
   rounding is 2^-8 = 0.4%: a different reduction order in attention's backward or in the gradient all-reduce moves
   a few of them); on CPU ranks in float32 the CPU test's 1e-5 and 1e-4.
2. Speed, Flux-dev 1024^2 (the real config, random weights, as ``bench/run.py`` builds it; micro-batch 1, no
   checkpointing, eager: compiling would cost every rank a minute of the budget): 1, 2 and 4 pipeline stages at
   gradient accumulation 8 and 16, data parallel on 2, 4 and 8 GPUs, and 2 stages x 2 data-parallel ranks
   (diffusion-pipe#330's layout). ``samples/s`` is the median step's after ``--warmup`` (default 8 steps, 2 warm-up).
3. With ``--heavy``: ``flux2`` a full fine-tune of Flux 2 dev (32B, every block checkpointed, AdamW) over all N GPUs
   as stages (N >= 4); ``wan14b`` a Wan 2.1 14B LoRA at 720p x 81 frames (960^2 clips: the same area) over
   min(N, 4) stages, every block checkpointed: samples/s and each GPU's peak memory.

Efficiency (one definition for both kinds of parallelism). A run on p stages x d data-parallel ranks with m
micro-batches a step (gradient accumulation) is compared with 1 stage on 1 GPU at the same m:
    speed-up = samples/s / samples/s on one GPU
    ideal    = d * p * m / (m + p - 1)        (1F1B's bubble: each stage idles (p - 1) of m + p - 1 slots)
    efficiency = speed-up / ideal             (the issue's targets: >= 90% of the bound, >= 90% of linear)
With p = 1 the ideal is d (linear data-parallel scaling), so efficiency is the share of linear scaling.

Each case runs in a child process of its own (its own session: a timeout kills it with every rank it started); a
failed case keeps the end of its log and the rest go on. Results go to ``multi_gpu.json`` and ``multi_gpu.md`` under
``--out`` after every case (two files: the GPU machine brings back at most eight); logs stay under ``--work``.
``--merge A.json B.json --out DIR`` joins the reports of several calls on one machine and recomputes the efficiencies.

``--device cpu --size micro`` runs the same code paths with gloo ranks on the micro Flux at 64^2
(``tests/ranks/test_bench_multi_gpu_runs.py``): the figures mean nothing there, the arithmetic and the JSON are checked.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from pipetrain.bench.run import CASES, Case, free_disk_for, run_ours, train_run, write_models, written_models

TOLERANCE = {"cuda": {"loss_rel": 1e-2, "lora_rel": 2e-2, "dtype": "bfloat16"},
             "cpu": {"loss_rel": 1e-5, "lora_rel": 1e-4, "dtype": "float32"}}
EFFICIENCY_TARGET = 0.9


@dataclass(frozen=True)
class Job:
    name: str
    gpus: int                          # GPUs it needs
    estimate_s: int                    # a first guess of its wall time on GPUs (model files, loading, steps)
    case: Case | None = None           # a timed run (bench/run.py's Case)
    equivalence: str | None = None     # "stages" | "data_parallel"
    heavy: str | None = None           # the --heavy name that turns it on
    steps: int | None = None           # heavy cases: fewer, longer steps
    warmup: int | None = None


def flux(stages: int, ga: int, dp: int = 1) -> Case:
    return replace(CASES["flux-1024-1stage-ga8"], stages=stages, gradient_accumulation=ga, data_parallel=dp)


def jobs(gpus: int) -> list[Job]:
    """Every case in order of value; the heavy ones sized to ``gpus``."""
    speed = [("flux-1024-1stage-ga8", 1, 150, flux(1, 8)), ("flux-1024-2stages-ga8", 2, 120, flux(2, 8)),
             ("flux-1024-dp2-ga8", 2, 120, flux(1, 8, 2)), ("flux-1024-1stage-ga16", 1, 120, flux(1, 16)),
             ("flux-1024-2stages-ga16", 2, 120, flux(2, 16)), ("flux-1024-4stages-ga8", 4, 120, flux(4, 8)),
             ("flux-1024-4stages-ga16", 4, 120, flux(4, 16)), ("flux-1024-dp4-ga8", 4, 120, flux(1, 8, 4)),
             ("flux-1024-2stages-dp2-ga8", 4, 120, flux(2, 8, 2)), ("flux-1024-dp8-ga8", 8, 150, flux(1, 8, 8))]
    flux2_stages, wan_stages = min(gpus, 8), max(2, min(gpus, 4))
    return [Job("equiv-stages", 2, 90, equivalence="stages"), Job("equiv-dp", 2, 90, equivalence="data_parallel"),
            *(Job(name, n, estimate, case=case) for name, n, estimate, case in speed),
            Job(f"flux2-1024-fullft-{flux2_stages}stages-ga8", max(4, flux2_stages), 480, heavy="flux2", steps=4,
                warmup=1, case=Case("flux2", 1024, 1, checkpointing=True, stages=flux2_stages,
                                    gradient_accumulation=8, full_finetune=True)),
            # about 50 s of one GPU a sample (75,600 tokens): two steps, the second timed
            Job(f"wan14b-720x1280x81-{wan_stages}stages-ga{2 * wan_stages}", wan_stages, 500, heavy="wan14b",
                steps=2, warmup=1, case=Case("wan", 960, 1, checkpointing=True, frames=81, stages=wan_stages,
                                             gradient_accumulation=2 * wan_stages))]


def plan(gpus: int, names: list[str] | None, heavy: list[str]) -> list[tuple[Job, str | None]]:
    """The jobs to run (``names``: those only, in the order of value) with the reason each is skipped, or None."""
    chosen = [j for j in jobs(gpus) if (j.name in names if names else j.heavy is None or j.heavy in heavy)]
    if names and len(chosen) != len(names):
        known = ", ".join(j.name for j in jobs(gpus))
        raise SystemExit(f"unknown case in --cases {','.join(names)}; the cases: {known}")
    return [(j, f"needs {j.gpus} GPUs, {gpus} here" if j.gpus > gpus else None) for j in chosen]


# --- figures --------------------------------------------------------------------------------------------------
def bubble_bound(stages: int, micro_batches: int) -> float:
    """The share of a 1F1B step each stage computes: m / (m + p - 1)."""
    return micro_batches / (micro_batches + stages - 1)


def efficiency(samples_per_s: float, single_gpu: float, stages: int, micro_batches: int, data_parallel: int) -> dict:
    """The speed-up over one GPU against the ideal d * p * m / (m + p - 1) (the module's docstring)."""
    speedup = samples_per_s / single_gpu
    ideal = data_parallel * stages * bubble_bound(stages, micro_batches)
    return {"gpus": stages * data_parallel, "speedup": speedup, "bubble_bound": bubble_bound(stages, micro_batches),
            "ideal_speedup": ideal, "efficiency": speedup / ideal, "target_met": speedup / ideal >= EFFICIENCY_TARGET}


def scaling(cases: dict) -> dict:
    """Every multi-GPU Flux run beside the one-GPU run at the same gradient accumulation."""
    timed = {n: r for n, r in cases.items() if r.get("case") and r.get("samples_per_s")}
    out = {}
    for name, r in timed.items():
        c = r["case"]
        if c["stages"] * c["data_parallel"] == 1:
            continue
        one_gpu = {**c, "stages": 1, "data_parallel": 1}
        single = next((o["samples_per_s"] for o in timed.values() if o["case"] == one_gpu), None)
        if single:
            out[name] = efficiency(r["samples_per_s"], single, c["stages"], c["gradient_accumulation"],
                                   c["data_parallel"])
    return out


def differences(reference: list[float], other: list[float]) -> tuple[float, float]:
    """Largest absolute and relative difference of two equal-length lists (inf where lengths differ or a value is
    not finite)."""
    if len(reference) != len(other) or not reference:
        return math.inf, math.inf
    pairs = [(a, b) for a, b in zip(reference, other)]
    if not all(math.isfinite(a) and math.isfinite(b) for a, b in pairs):
        return math.inf, math.inf
    return (max(abs(a - b) for a, b in pairs), max(abs(a - b) / max(abs(a), 1e-12) for a, b in pairs))


def lora_differences(reference: Path, other: Path) -> dict:
    """Per tensor, the largest |a - b| and that over the tensor's largest |a|; the largest over tensors, and whether
    training moved the LoRA at all (lora_B starts at zero)."""
    from safetensors.torch import load_file

    a, b = load_file(str(reference)), load_file(str(other))
    if a.keys() != b.keys():
        return {"lora_max_abs": math.inf, "lora_max_rel": math.inf, "lora_keys_differ": sorted(a.keys() ^ b.keys())}
    worst_abs = worst_rel = 0.0
    for k in a:
        x, y = a[k].float(), b[k].float()
        d = (x - y).abs().max().item()
        worst_abs, worst_rel = max(worst_abs, d), max(worst_rel, d / max(x.abs().max().item(), 1e-12))
    moved = any(v.abs().max().item() > 0 for k, v in a.items() if "lora_B" in k)
    return {"lora_max_abs": worst_abs, "lora_max_rel": worst_rel, "lora_tensors": len(a), "lora_moved": moved}


# --- one case (in its own process) ----------------------------------------------------------------------------
def run_equivalence(job: Job, args, root: Path) -> dict:
    """Two runs of the training CLI on the micro Flux that must agree (the CPU equivalence test's configuration)."""
    from pipetrain.backend.commands.demo import make_dataset, write_configs
    from pipetrain.backend.models.tiny import cached_model_files

    tolerance = TOLERANCE[args.device]
    files = cached_model_files("flux", args.equiv_size)
    if job.equivalence == "stages":
        runs = {"one_stage_1gpu": (1, {"pipeline_stages": 1}), "two_stages_2gpus": (2, {"pipeline_stages": 2})}
    else:
        runs = {"accumulation_1x2": (1, {"pipeline_stages": 1, "gradient_accumulation_steps": 2}),
                "data_parallel_2x1": (2, {"pipeline_stages": 1})}
    out: dict = {"tolerance": tolerance, "steps": args.equiv_steps, "model": f"flux-{args.equiv_size}"}
    found = {}
    for label, (ranks, overrides) in runs.items():
        folder = root / f"{job.name}-{label}"
        shutil.rmtree(folder, ignore_errors=True)
        make_dataset(folder / "dataset", 2 * args.equiv_steps)     # a global batch of 2 for every step
        config = write_configs(folder, files, epochs=1, max_steps=args.equiv_steps, gradient_clipping=0.0,
                               checkpoint_every_n_epochs=None, run_name="bench", model={"dtype": tolerance["dtype"]},
                               optimizer={"type": "sgd", "lr": args.equiv_lr, "weight_decay": 0.0}, **overrides)
        text = config.with_name("dataset.toml").read_text()     # one bucket: any micro-batch can be formed
        config.with_name("dataset.toml").write_text(text.replace("enable_ar_bucket = true", "enable_ar_bucket = false"))
        log = root / f"{job.name}-{label}.log"
        rc, events = train_run(config, ranks, log)
        losses = [e["loss"] for e in events if e["type"] == "step"]
        loras = [e["path"] for e in events if e["type"] == "lora_saved"]
        out[label] = {"rc": rc, "ranks": ranks, "losses": losses}
        if rc != 0 or not loras:
            out[label]["log_tail"] = log.read_text(errors="replace")[-3000:]
            return {**out, "passed": False}
        found[label] = (losses, Path(loras[-1]))
    (ref_losses, ref_lora), (losses, lora) = found.values()
    out["loss_max_abs"], out["loss_max_rel"] = differences(ref_losses, losses)
    out.update(lora_differences(ref_lora, lora))
    out["passed"] = bool(out["loss_max_rel"] <= tolerance["loss_rel"] and out["lora_max_rel"] <= tolerance["lora_rel"]
                         and out.get("lora_moved"))
    return out


def run_timed(job: Job, args, root: Path) -> dict:
    case = job.case
    freed = free_disk_for(root, f"{case.arch}-full") if job.heavy else []
    # in a process of its own: the weights are drawn on a GPU, whose memory this process should not keep while the
    # ranks train
    files = written_models(case, root, args.size)   # already there: no process to start
    if files is None:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            files = pool.submit(write_models, case, root, args.size).result()
    small = args.size != "full"   # a smoke test of the code path: small pictures and short clips
    resolution = args.resolution if small else None
    frames = args.frames if small and case.frames > 1 else None
    # stopped once training ends (the memory event), before the final saves: a full fine-tune's would write
    # its whole model and a checkpoint with the optimizer states (hundreds of GB for Flux 2)
    result = run_ours(job.name, case, files, root, job.steps or args.steps, job.warmup or args.warmup,
                      stop_after="memory", resolution=resolution, frames=frames)
    return {"case": asdict(case), **result, **({"freed": freed} if freed else {})}


def child(args) -> int:
    """Run the one case ``args.child`` and write its result to ``args.child_result``."""
    job = next(j for j in jobs(args.gpus) if j.name == args.child)
    root = Path(args.work)
    root.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    result = run_equivalence(job, args, root) if job.equivalence else run_timed(job, args, root)
    result["wall_s"] = round(time.monotonic() - started, 1)
    Path(args.child_result).write_text(json.dumps(result))
    return 0


# --- the command ----------------------------------------------------------------------------------------------
def run_job(job: Job, args, timeout_s: float) -> dict:
    """The case in a child process of its own session, killed with every rank it started at ``timeout_s``."""
    work = Path(args.work)
    result_file, log = work / f"{job.name}.result.json", work / f"{job.name}.child.log"
    result_file.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("NCCL_DEBUG", "WARN")   # NCCL's own reason for a failure lands in the log's tail
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    argv = [sys.executable, str(Path(__file__).resolve()), *args.argv, "--gpus", str(args.gpus),
            "--child", job.name, "--child-result", str(result_file)]
    started = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = 124
    if rc == 0 and result_file.exists():
        return json.loads(result_file.read_text())
    why = f"timed out after {timeout_s:.0f} s" if rc == 124 else f"exited with {rc}"
    runs = sorted((p for p in work.glob(f"{job.name}*.log") if p != log), key=lambda p: p.stat().st_mtime)
    return {"rc": rc, "error": why, "wall_s": round(time.monotonic() - started, 1),
            "log_tail": log.read_text(errors="replace")[-3000:],   # the case's own process: a traceback
            **({"run_log_tail": runs[-1].read_text(errors="replace")[-3000:]} if runs else {})}   # where it hung


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--work", default="/tmp/pipetrain-multi-gpu")
    p.add_argument("--gpus", type=int, default=None, help="GPUs (ranks) to use; default: torch.cuda.device_count()")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: gloo ranks (a smoke test)")
    p.add_argument("--size", default="full", help="speed cases' model size: full, or tiny / micro on the CPU")
    p.add_argument("--resolution", type=int, default=64, help="with --size other than full")
    p.add_argument("--frames", type=int, default=9, help="video cases' clip length with --size other than full")
    p.add_argument("--cases", default="", help="comma-separated case names (default: every case but the heavy)")
    p.add_argument("--heavy", default="", help="also run these heavy cases: flux2, wan14b")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--equiv-size", default="micro")
    p.add_argument("--equiv-steps", type=int, default=3)
    p.add_argument("--equiv-lr", type=float, default=0.5)
    p.add_argument("--budget-s", type=float, default=540, help="start no case once less is left than its estimate")
    p.add_argument("--case-timeout-s", type=float, default=560)
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="no runs: merge these reports (later cases win) into --out, with the scaling recomputed "
                        "(several calls on one warm machine: the same GPUs)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)   # a case's child process gets them again
    args.work = str(Path(args.work).resolve())   # the trainer runs in its config's folder: paths must be absolute
    if args.gpus is None:
        import torch
        args.gpus = torch.cuda.device_count() if args.device == "cuda" else 2
    if args.child:
        return child(args)
    if args.merge:
        return merge(args.merge, Path(args.out))
    return run_all(args)


def run_all(args) -> int:
    started = time.monotonic()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    cuda = args.device == "cuda"
    report = {"gpus": args.gpus, "device": args.device, "size": args.size, "budget_s": args.budget_s,
              "gpu_names": nvidia_smi("--query-gpu=name", "--format=csv,noheader").splitlines() if cuda else [],
              "gpu_links": nvidia_smi("topo", "-m") if cuda else "", "cases": {}}
    names = [n for n in args.cases.split(",") if n]
    for job, skip in plan(args.gpus, names, [h for h in args.heavy.split(",") if h]):
        left = args.budget_s - (time.monotonic() - started)
        need = job.estimate_s if args.device == "cuda" else 1   # the estimates are GPU wall times
        if skip is None and left < need:
            skip = f"budget: {left:.0f} s left of {args.budget_s:.0f}, the case needs about {need} s"
        print(f"[multi-gpu] {job.name}: {skip or f'running ({left:.0f} s of budget left)'}", flush=True)
        result = {"skipped": skip} if skip else run_job(job, args, min(args.case_timeout_s, left))
        report["cases"][job.name] = {"gpus": job.gpus, **result}
        report["scaling"] = scaling(report["cases"])
        report["wall_s"] = round(time.monotonic() - started, 1)
        (out / "multi_gpu.json").write_text(json.dumps(report, indent=1))
        (out / "multi_gpu.md").write_text(markdown(report))
    print(markdown(report))
    return 0


def merge(files: list[str], out: Path) -> int:
    reports = [json.loads(Path(f).read_text()) for f in files]
    report = {**reports[-1], "merged_from": files, "cases": {k: v for r in reports for k, v in r["cases"].items()},
              "wall_s": sum(r.get("wall_s", 0) for r in reports), "budget_s": sum(r["budget_s"] for r in reports)}
    report["scaling"] = scaling(report["cases"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "multi_gpu.json").write_text(json.dumps(report, indent=1))
    (out / "multi_gpu.md").write_text(markdown(report))
    print(markdown(report))
    return 0


def nvidia_smi(*args: str) -> str:
    """nvidia-smi's answer ('' without it): this process keeps off the GPUs its cases measure."""
    try:
        return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _f(x, pattern: str = "{:.2f}") -> str:
    return "-" if x is None else pattern.format(x)


def markdown(report: dict) -> str:
    """The tables docs/benchmarks.md's GPU section takes."""
    names = ", ".join(sorted(set(report["gpu_names"]))) or report["device"]
    lines = [f"{report['gpus']} x {names}; wall {report.get('wall_s', 0):.0f} s of a {report['budget_s']:.0f} s budget",
             "", "| case | GPUs | samples/s | step s | peak GiB per GPU | status |", "|---|---|---|---|---|---|"]
    for name, r in report["cases"].items():
        peaks = r.get("peak_gib_per_rank")
        memory = " / ".join(f"{g:.1f}" for g in peaks) if peaks else _f(r.get("peak_gib") or None, "{:.1f}")
        lines.append(f"| {name} | {r['gpus']} | {_f(r.get('samples_per_s'))} | {_f(r.get('step_s'))} | {memory} | "
                     f"{_status(r)} |")
    equivalences = {name: r for name, r in report["cases"].items() if "tolerance" in r}
    if equivalences:
        lines += ["", "| equivalence | loss max abs | loss max rel | LoRA max abs | LoRA max rel (of the tensor's "
                  "max) | tolerance (loss / LoRA rel) | verdict |", "|---|---|---|---|---|---|---|"]
        for name, r in equivalences.items():
            t, e = r["tolerance"], "{:.2e}"
            lines.append(f"| {name} | {_f(r.get('loss_max_abs'), e)} | {_f(r.get('loss_max_rel'), e)} | "
                         f"{_f(r.get('lora_max_abs'), e)} | {_f(r.get('lora_max_rel'), e)} | "
                         f"{t['loss_rel']:g} / {t['lora_rel']:g} ({t['dtype']}) | "
                         f"{'pass' if r['passed'] else 'FAIL'} |")
    if report.get("scaling"):
        lines += ["", "| case | GPUs | speed-up over 1 GPU | bubble bound m/(m+p-1) | ideal speed-up | efficiency "
                  f"(target {EFFICIENCY_TARGET:.0%}) |", "|---|---|---|---|---|---|"]
        for name, e in report["scaling"].items():
            verdict = "met" if e["target_met"] else "missed"
            lines.append(f"| {name} | {e['gpus']} | {e['speedup']:.2f}x | {e['bubble_bound']:.0%} | "
                         f"{e['ideal_speedup']:.2f}x | {e['efficiency']:.0%} ({verdict}) |")
    return "\n".join(lines) + "\n"


def _status(r: dict) -> str:
    if r.get("skipped"):
        return f"skipped: {r['skipped']}"
    if "tolerance" in r:
        return "equal within tolerance" if r["passed"] else "NOT equal, or a run failed (see the JSON)"
    return r.get("error") or ("ok" if r.get("rc") == 0 else f"failed (rc {r.get('rc')}; see the JSON)")

if __name__ == "__main__":
    raise SystemExit(main())
