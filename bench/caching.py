"""PipeTrain's caching benchmark: images/s encoding pictures with the Flux VAE and captions/s with its text encoders
(CLIP-L and T5-XXL) through PipeTrain's cache job, against a bare loop over the same ComfyUI encoders in the same
job.

    python bench/caching.py --out $OUT [--images 128] [--resolution 1024] [--batch 4] [--work /tmp/...]

Model files are random-initialised at the published sizes (``models.tiny``: the real Flux VAE, CLIP-L and T5-XXL
in bfloat16, written on the GPU; a micro diffusion model, which caching never loads). The dataset is ``--images``
JPEG pictures of noise at ``--resolution``² (a photograph's decoding cost), each with its own caption as long as
the training benchmark's (505 T5 tokens), so no two captions share a cache entry.

- ``pipetrain``: ``pipetrain cache`` under DeepSpeed's launcher with ``caching_batch_size = --batch``, as a run
  caches: scanning, keys and manifest, then every latent and every caption, each stored as a file. The rates come
  from the job's own progress events (``events.jsonl``), from the end of the first batch (model loading and the
  first kernels' tuning left out) to the last.
- ``bare``: a process that loads the same files with ComfyUI's loaders at ComfyUI's default dtypes, holds every
  picture's pixels in memory (decoded before the clock starts) and calls ``vae.encode`` on batches of the same
  size, then ``clip.encode_from_tokens`` on every caption, first batch and caption again left out. Captions are
  encoded twice: with the text encoders at ComfyUI's default dtype and in float32, the dtype the cache job loads
  them in, so the ratio shows what the dtype costs and what the job's own work costs.

Writes ``caching.json`` into ``--out`` and prints the rates and ratios. ``--size micro --resolution 64`` runs the
same code on the CPU with the shared micro model files (a smoke test, no figures; with ``--short-captions``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ARCH = "flux"


def write_models(root: Path, size: str) -> dict:
    """The Flux files: full-size VAE and text encoders (the micro diffusion model is never loaded by caching), or
    the shared micro files for a smoke test."""
    from pipetrain.backend.models.tiny import cached_model_files, write_model_files

    if size == "micro":
        files = cached_model_files(ARCH, "micro")
    else:
        marker = root / "models.json"
        if marker.exists():
            return json.loads(marker.read_text())
        import torch
        files = write_model_files(ARCH, root / "models", "micro", torch.bfloat16, text_encoder_size="full",
                                  init_device="cuda" if torch.cuda.is_available() else "cpu")
    data = {"diffusion_model": str(files.diffusion_model), "vae": str(files.vae),
            "text_encoders": [str(p) for p in files.text_encoders]}
    if size != "micro":
        (root / "models.json").write_text(json.dumps(data))
    return data


def write_pictures(folder: Path, count: int, side: int, short_captions: bool = False) -> None:
    """``count`` JPEGs of colour noise, ``side`` pixels square, each with its own caption (the training bench's
    length, or a phrase for a smoke test)."""
    import numpy as np
    from PIL import Image

    from pipetrain.bench.run import BENCH_PHRASE, bench_caption

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        pixels = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"pic{i:04d}.jpg", quality=90)
        text = BENCH_PHRASE if short_captions else bench_caption(ARCH)
        (folder / f"pic{i:04d}.txt").write_text(f"picture {i}: {text}")


def write_config(root: Path, files: dict, side: int, batch: int) -> Path:
    import tomli_w

    (root / "dataset.toml").write_text(tomli_w.dumps({
        "resolutions": [side], "enable_ar_bucket": False,
        "directory": [{"path": str(root / "dataset"), "num_repeats": 1}]}))
    (root / "run.toml").write_text(tomli_w.dumps({
        "output_dir": str(root / "output"), "dataset": str(root / "dataset.toml"), "epochs": 1, "run_name": "caching",
        "caching_batch_size": batch, "micro_batch_size_per_gpu": 1,
        "model": {"type": ARCH, "diffusion_model": files["diffusion_model"], "vae": files["vae"],
                  "text_encoders": files["text_encoders"], "dtype": "bfloat16"},
        "adapter": {"rank": 16}, "optimizer": {"type": "adamw", "lr": 1e-4}}))
    return root / "run.toml"


def rate(events: list[dict], kind: str) -> dict:
    """Items/s of one kind of cache progress event, from the first event (the first batch done) to the last."""
    marks = [(e["time"], e["done"]) for e in events if e.get("type") == "cache" and e.get("kind") == kind]
    if len(marks) < 2:
        return {"events": len(marks)}
    (t0, d0), (t1, d1) = marks[0], marks[-1]
    return {"per_s": (d1 - d0) / (t1 - t0), "timed": d1 - d0, "seconds": t1 - t0, "total": marks[-1][1]}


def run_pipetrain(config: Path) -> dict:
    """``pipetrain cache`` on one rank; its rates from events.jsonl."""
    from pipetrain.backend.run.folder import RunDir
    from pipetrain.bench.ranks import start_ranks

    log = config.parent / "pipetrain-cache.log"
    t = time.monotonic()
    rc = start_ranks("cache", config, 1, [], log, dict(os.environ)).wait()
    wall = time.monotonic() - t
    events_file = RunDir(config.parent / "output" / "cache").events_file   # a cache-only job reports beside its cache
    events = [json.loads(x) for x in events_file.read_text().splitlines()] if events_file.exists() else []
    result = {"rc": rc, "wall_s": wall, "latents": rate(events, "latents"), "texts": rate(events, "text")}
    if rc != 0 or "per_s" not in result["latents"]:
        result["log_tail"] = log.read_text(errors="replace")[-3000:]
    return result


def _timed(calls, warmup: int = 1) -> dict:
    """Items/s over ``calls`` (each a callable handling some items, returning how many), the first ``warmup``
    left out; every call returns its result on the host, so the clock sees finished work."""
    for call in calls[:warmup]:
        call()
    t, done = time.perf_counter(), 0
    for call in calls[warmup:]:
        done += call()
    seconds = time.perf_counter() - t
    return {"per_s": done / seconds, "timed": done, "seconds": seconds}


def _dtype(module) -> str:
    return str(next(module.parameters()).dtype).replace("torch.", "")


def bare(config: Path, batch: int) -> dict:
    """The bare loop (run in its own process): ComfyUI's VAE and CLIP objects called directly on pixels held in
    memory and on the captions."""
    import numpy as np
    import torch
    from PIL import Image

    from pipetrain.backend.cache.builder import _free as free     # as the cache job frees between its phases
    from pipetrain.backend.config import load_run_config
    from pipetrain.backend.models.loading import load_text_encoders, load_vae
    from pipetrain.backend.host.runtime import ensure_comfyui

    ensure_comfyui()
    cfg = load_run_config(config)
    folder = Path(cfg.dataset_config.directory_path(cfg.dataset_config.directory[0]))
    pictures = sorted(folder.glob("*.jpg"))
    captions = [p.with_suffix(".txt").read_text() for p in pictures]
    pixels = torch.stack([torch.from_numpy(np.asarray(Image.open(p).convert("RGB"), dtype=np.float32) / 255.0)
                          for p in pictures])
    vae = load_vae(cfg.resolve(cfg.model.vae))
    batches = [pixels[i:i + batch] for i in range(0, len(pixels), batch)]
    out = {"vae_dtype": str(vae.vae_dtype).replace("torch.", ""),
           "latents": _timed([lambda b=b: vae.encode(b).shape[0] for b in batches])}
    del vae
    free()
    paths = [cfg.resolve(p) for p in cfg.model.text_encoders]
    for name, dtype in (("texts", None), ("texts_float32", torch.float32)):
        clip = load_text_encoders(paths, ARCH, dtype)
        out[f"{name}_dtype"] = _dtype(clip.cond_stage_model)
        out[name] = _timed([lambda c=c: len(clip.encode_from_tokens(clip.tokenize(c), return_pooled=True,
                                                                    return_dict=True)["cond"]) for c in captions])
        del clip
        free()
    return out


def run_bare(config: Path, batch: int) -> dict:
    # this file by its path: the child imports pipetrain however this process did
    cmd = [sys.executable, __file__, "--bare-config", str(config), "--batch", str(batch)]
    child = subprocess.run(cmd, capture_output=True, text=True)
    lines = [x for x in child.stdout.splitlines() if x.startswith("{")]
    if child.returncode != 0 or not lines:
        return {"rc": child.returncode, "stderr": child.stderr[-3000:]}
    return json.loads(lines[-1])


def ratios(result: dict) -> dict:
    ours, base = result["pipetrain"], result["bare"]

    def ratio(a: dict, b: dict):
        return a["per_s"] / b["per_s"] if "per_s" in a and "per_s" in b else None
    return {"latents": ratio(ours.get("latents", {}), base.get("latents", {})),
            "texts": ratio(ours.get("texts", {}), base.get("texts", {})),
            "texts_same_dtype": ratio(ours.get("texts", {}), base.get("texts_float32", {}))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--work", default="/tmp/pipetrain-bench-caching")
    p.add_argument("--images", type=int, default=128)
    p.add_argument("--resolution", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4, help="caching_batch_size, and the bare loop's batch")
    p.add_argument("--size", default="full", help="full (figures) or micro (a CPU smoke test)")
    p.add_argument("--short-captions", action="store_true", help="one phrase per caption (a CPU smoke test)")
    p.add_argument("--bare-config", type=Path, help=argparse.SUPPRESS)    # the bare loop's own process
    args = p.parse_args()
    if args.bare_config:
        print(json.dumps(bare(args.bare_config, args.batch)))
        return 0
    root, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = write_models(root, args.size)
    job = root / f"job-{args.images}x{args.resolution}"
    shutil.rmtree(job, ignore_errors=True)      # a fresh cache: everything is encoded
    write_pictures(job / "dataset", args.images, args.resolution, args.short_captions)
    config = write_config(job, files, args.resolution, args.batch)
    result = {"images": args.images, "resolution": args.resolution, "batch": args.batch, "size": args.size,
              "pipetrain": run_pipetrain(config), "bare": run_bare(config, args.batch)}
    result["ratios"] = ratios(result)
    (out / "caching.json").write_text(json.dumps(result, indent=1))
    shutil.rmtree(job, ignore_errors=True)
    for kind in ("latents", "texts"):
        ours, base = result["pipetrain"].get(kind, {}), result["bare"].get(kind, {})
        print(f"{kind:8s} pipetrain {ours.get('per_s', float('nan')):8.2f}/s  bare {base.get('per_s', float('nan')):8.2f}/s"
              f"  ratio {result['ratios'][kind] or float('nan'):.2f}")
    print(f"texts vs the bare loop in float32: {result['ratios']['texts_same_dtype'] or float('nan'):.2f}")
    return 0 if result["pipetrain"].get("rc") == 0 and "latents" in result["bare"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
