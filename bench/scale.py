"""PipeTrain's CPU scale case: what a run does with a dataset before it encodes anything, timed on synthetic
datasets of growing size.

    python bench/scale.py --counts 1000,10000,100000 --out $OUT [--work /tmp] [--profile]

For each count, a dataset of that many captioned pictures (``synthetic_dataset.py``: PNG and JPEG of 24 sizes,
some EXIF-rotated, at several aspect ratios, with 7 aspect-ratio buckets) is written into a temporary folder
under ``--work`` and deleted afterwards. A fresh Python process then runs the cache job's own functions on it, as
``pipetrain cache`` and ``pipetrain train`` call them on rank 0, and reports each phase's wall time and the
process's CPU time (user and system, all threads) and peak resident memory (``ru_maxrss``; the figure after the
imports is reported too). The wall time depends on what else the machine runs; the CPU time much less:

- ``samples``: scanning the folder (each picture's size and orientation, each caption), aspect-ratio buckets and
  caption variants (``train.caching._examples``);
- ``manifest``: every file's digest and cache keys, written as the cache manifest (``build_or_load_manifest``);
- ``missing``: the manifest read back and the cache looked up for every key (``CacheManifest.load``,
  ``missing_work``);
- ``plan``: the epoch plan and epoch 0's batches (``EpochPlan``, as ``train.engine.trainer_plan`` builds it).

Model files are stand-ins of a few bytes: the cache keys hash them once per cache folder, whatever the dataset's
size. Writes ``scale.json`` (and with ``--profile`` one ``profile-N.txt`` per count, the cumulative cProfile of
the measured phases) into ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PHASES = ("samples", "manifest", "missing", "plan")
BUCKETS = 7          # num_ar_buckets, aspect ratios 0.5 to 2.0
RESOLUTION = 1024
BATCH = 4            # micro batch: the plan groups samples into single-bucket batches of this many


def write_configs(root: Path, dataset: Path) -> Path:
    """run.toml and dataset.toml for a Flux LoRA run over ``dataset``, with stand-in model files."""
    import tomli_w

    models = root / "models"
    models.mkdir(parents=True, exist_ok=True)
    names = {"diffusion_model": "flux.safetensors", "vae": "ae.safetensors", "clip": "clip_l.safetensors",
             "t5": "t5xxl.safetensors"}
    for name in names.values():
        (models / name).write_bytes(b"stand-in " + name.encode())
    (root / "dataset.toml").write_text(tomli_w.dumps({
        "resolutions": [RESOLUTION], "enable_ar_bucket": True, "min_ar": 0.5, "max_ar": 2.0,
        "num_ar_buckets": BUCKETS, "directory": [{"path": str(dataset), "num_repeats": 1}]}))
    (root / "run.toml").write_text(tomli_w.dumps({
        "output_dir": str(root / "output"), "dataset": str(root / "dataset.toml"), "epochs": 1,
        "micro_batch_size_per_gpu": BATCH, "run_name": "scale",
        "model": {"type": "flux", "diffusion_model": str(models / names["diffusion_model"]),
                  "vae": str(models / names["vae"]),
                  "text_encoders": [str(models / names["clip"]), str(models / names["t5"])]},
        "adapter": {"rank": 16}, "optimizer": {"type": "adamw", "lr": 1e-4}}))
    return root / "run.toml"


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024    # Linux: KiB


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(config: Path, profile: Path | None = None) -> dict:
    """The phases on the dataset ``config`` names, in this process (run it in a fresh one: the peak memory is
    the process's)."""
    from pipetrain.backend.cache import CacheStore
    from pipetrain.backend.cache.builder import missing_work
    from pipetrain.backend.cache.manifest import CacheManifest, build_or_load_manifest, manifest_path
    from pipetrain.backend.config import load_run_config
    from pipetrain.backend.data import EpochPlan
    from pipetrain.backend.models.registry import adapter_class
    from pipetrain.backend.train.caching import _examples
    from pipetrain.backend.train.events import RunReporter

    cfg = load_run_config(config)
    adapter = adapter_class(cfg.model.type)(cfg.model, cfg.resolve)
    store = CacheStore(cfg.resolve(cfg.output_dir) / "cache")
    run_dir = cfg.resolve(cfg.output_dir) / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    reporter = RunReporter(run_dir, enabled=True)
    manifest = manifest_path(store.root, cfg.resolve(cfg.dataset), adapter.arch)
    files = adapter.model_files()
    rss_imports = _rss_mib()
    times, out = {}, {}

    def samples():
        out["samples"] = _examples(cfg.dataset_config, cfg.seed, reporter, "dataset", adapter)

    def manifest_phase():
        build_or_load_manifest(manifest, lambda: out["samples"], adapter, files, False, store.fingerprint)

    def missing():
        out["entries"] = CacheManifest.load(manifest).entries
        out["missing"] = missing_work(out["entries"], store)

    def plan():
        entries = out["entries"]
        out["plan"] = EpochPlan(entries, [e.num_repeats for e in entries], cfg.micro_batch_size_per_gpu,
                                cfg.gradient_accumulation_steps, 0, 1, cfg.seed)
        out["batches"] = out["plan"].epoch(0)

    cpu = _cpu_s()
    profiler = None
    if profile:
        import cProfile
        profiler = cProfile.Profile()
    for name, phase in zip(PHASES, (samples, manifest_phase, missing, plan)):
        t = time.perf_counter()
        if profiler:
            profiler.runcall(phase)
        else:
            phase()
        times[name] = round(time.perf_counter() - t, 3)
    if profiler:
        import io
        import pstats
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(45)
        profile.write_text(text.getvalue())
    buckets = sorted({tuple(s.bucket) for s in out["samples"]})
    return {"images": len(out["samples"]), "entries": len(out["entries"]),
            "missing_latents": len(out["missing"][0]), "missing_texts": len(out["missing"][1]),
            "buckets": [list(b) for b in buckets], "steps": len(out["batches"]),
            "seconds": times, "total_s": round(sum(times.values()), 3), "cpu_s": round(_cpu_s() - cpu, 2),
            "rss_after_imports_mib": round(rss_imports), "peak_rss_mib": round(_rss_mib())}


def run_count(count: int, work: Path, profile: Path | None = None) -> dict:
    """Write a dataset of ``count`` pictures under ``work``, measure it in a child process, delete it."""
    from pipetrain.bench.synthetic_dataset import write_dataset

    root = Path(tempfile.mkdtemp(prefix=f"pipetrain-scale-{count}-", dir=work))
    try:
        t = time.perf_counter()
        write_dataset(root / "dataset", count)
        written = round(time.perf_counter() - t, 1)
        config = write_configs(root, root / "dataset")
        # this file by its path: the child imports pipetrain however this process did
        cmd = [sys.executable, __file__, "--measure", str(config)]
        if profile:
            cmd += ["--profile-to", str(profile)]
        child = subprocess.run(cmd, capture_output=True, text=True)
        if child.returncode != 0:
            return {"count": count, "rc": child.returncode, "stderr": child.stderr[-3000:]}
        return {"count": count, "write_dataset_s": written, **json.loads(child.stdout.splitlines()[-1])}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def growth(results: list[dict]) -> list[str]:
    """Each count's time and memory per picture against the smallest count's, as lines of text."""
    done = [r for r in results if "total_s" in r]
    lines = [f"{'images':>8s} {'total s':>8s} " + " ".join(f"{p + ' s':>11s}" for p in PHASES)
             + f" {'CPU s':>6s} {'peak MiB':>9s} {'after imports':>13s} {'µs/image':>9s}"]
    for r in done:
        lines.append(f"{r['count']:8d} {r['total_s']:8.2f} " + " ".join(f"{r['seconds'][p]:11.2f}" for p in PHASES)
                     + f" {r['cpu_s']:6.2f} {r['peak_rss_mib']:9d} {r['rss_after_imports_mib']:13d} "
                     f"{r['total_s'] / r['count'] * 1e6:9.0f}")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--counts", default="1000,10000,100000")
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--work", default=tempfile.gettempdir(), help="where the temporary datasets are written")
    p.add_argument("--profile", action="store_true", help="also write profile-N.txt (cProfile, cumulative)")
    p.add_argument("--measure", type=Path, help=argparse.SUPPRESS)       # the child: one run.toml
    p.add_argument("--profile-to", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.profile_to)))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for count in (int(c) for c in args.counts.split(",")):
        results.append(run_count(count, Path(args.work), out / f"profile-{count}.txt" if args.profile else None))
        (out / "scale.json").write_text(json.dumps({"cpu_count": os.cpu_count(), "results": results}, indent=1))
    print("\n".join(growth(results)))
    return 0 if all("total_s" in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
