"""The embedded default job: a tiny random-initialised Flux-architecture model, a generated dataset,
cache + 2-rank DeepSpeed pipeline training, then the newest epoch LoRA loaded by ComfyUI."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import tomli_w
from PIL import Image, ImageDraw

from ..run.folder import RunDir
from ..host.runtime import REPO_ROOT

COLOURS = [("red", (220, 40, 40)), ("green", (40, 180, 60)), ("blue", (40, 70, 220)), ("yellow", (230, 210, 40))]


def make_dataset(folder: Path, count: int = 8) -> Path:
    """``count`` captioned images of two aspect ratios (square and 3:2 landscape)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        name, rgb = COLOURS[i % len(COLOURS)]
        size = (96, 96) if i % 2 == 0 else (144, 96)
        img = Image.new("RGB", size, (245, 245, 240))
        draw = ImageDraw.Draw(img)
        r = 20 + 4 * (i % 3)
        cx, cy = size[0] // 2, size[1] // 2
        shape = "circle" if i % 4 < 2 else "square"
        box = (cx - r, cy - r, cx + r, cy + r)
        (draw.ellipse if shape == "circle" else draw.rectangle)(box, fill=rgb)
        img.save(folder / f"img{i:02d}.png")
        (folder / f"img{i:02d}.txt").write_text(f"a {name} {shape} on a white background")
    return folder


def write_configs(root: Path, files, stages: int = 2, epochs: int = 2, **overrides) -> Path:
    dataset = {"resolutions": [64], "enable_ar_bucket": True, "min_ar": 0.5, "max_ar": 2.0, "num_ar_buckets": 3,
               "directory": [{"path": str(root / "dataset"), "num_repeats": 1}]}
    run = {"output_dir": str(root / "output"), "dataset": str(root / "dataset.toml"), "epochs": epochs,
           "micro_batch_size_per_gpu": 1, "pipeline_stages": stages, "gradient_accumulation_steps": 1,
           "save_every_n_epochs": 1, "checkpoint_every_n_epochs": 1, "seed": 7,
           "model": {"type": "flux", "diffusion_model": str(files.diffusion_model), "vae": str(files.vae),
                     "text_encoders": [str(p) for p in files.text_encoders], "dtype": "float32"},
           "adapter": {"rank": 4, "alpha": 4.0}, "optimizer": {"type": "adamw", "lr": 2e-3}}
    for key, value in overrides.items():
        if value is None:
            run.pop(key, None)
        elif isinstance(value, dict) and isinstance(run.get(key), dict):
            run[key].update(value)
        else:
            run[key] = value
    (root / "dataset.toml").write_text(tomli_w.dumps(dataset))
    (root / "run.toml").write_text(tomli_w.dumps(run))
    return root / "run.toml"


def newest_run(output_dir: Path) -> RunDir:
    runs = [RunDir(p) for p in output_dir.iterdir() if p.is_dir()]
    return max((r for r in runs if r.status_file.exists()), key=lambda r: r.path.stat().st_mtime)


def run_demo(workdir: str | None, ranks: int) -> int:
    from ..config import load_run_config
    from ..process.command_lines import deepspeed_cli_command
    from ..models.tiny import cached_model_files
    from ..host.runtime import ensure_comfyui
    from ..parity.verify import check_lora

    root = Path(workdir) if workdir else REPO_ROOT / ".work" / "demo"
    root.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    ensure_comfyui()
    # "micro": Flux's structure 256 wide (its config in the file's metadata); the full-width "tiny" Flux, which
    # ComfyUI's own loader detects, is 2.2 GB alone and trains several times slower on a CPU
    print("[demo] micro random-initialised Flux-dev architecture (2 double + 2 single blocks, 256 wide)", flush=True)
    files = cached_model_files("flux", "micro")
    make_dataset(root / "dataset")
    config = write_configs(root, files, stages=min(2, ranks))
    cmd = deepspeed_cli_command("train", config, ranks)   # its exit status says whether the run finished
    print("[demo] $ " + " ".join(cmd), flush=True)
    rc = subprocess.run(cmd, cwd=root).returncode
    if rc != 0:
        print(f"[demo] training failed (exit {rc})")
        return rc
    run_dir = newest_run(root / "output")
    status = json.loads(run_dir.status_file.read_text())
    lora_path = Path(status["loras"][-1]["path"])
    check = check_lora(load_run_config(config), lora_path)
    print(f"""
[demo] finished in {time.monotonic() - started:.0f} s
  run directory     {run_dir}
  events / status   {run_dir.events_file}, {run_dir.status_file}
  epoch LoRAs       {', '.join(str(Path(x['path'])) for x in status['loras'])}
  checkpoints       {run_dir.checkpoints}
  TensorBoard       tensorboard --logdir {run_dir.tensorboard}
  final loss        {status.get('loss')}
  ComfyUI LoraLoaderModelOnly: {check.keys_loaded} weights patched; output differs from the base model by
  {check.lora_effect:.3g} (max abs) and matches the training-side output to {check.comfy_vs_training:.2g}.""")
    return 0
