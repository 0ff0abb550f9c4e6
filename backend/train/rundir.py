"""Choosing the run directory: a new one per run, or the one to resume."""
from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from ..config import RunConfig
from ..errors import ConfigError
from .checkpoint import latest_tag


def new_run_name() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")


def choose_run_dir(cfg: RunConfig, resume: str | None) -> Path:
    out = cfg.resolve(cfg.output_dir)
    if resume is None:
        name = cfg.run_name or new_run_name()
        run_dir = out / name
        n = 1
        while run_dir.exists() and any(run_dir.iterdir()) and not cfg.run_name:
            run_dir = out / f"{name}-{n}"
            n += 1
        run_dir.mkdir(parents=True, exist_ok=True)
        return run_dir
    if resume:
        run_dir = Path(resume) if Path(resume).is_absolute() else out / resume
        if not run_dir.is_dir():
            raise ConfigError(f"--resume {resume}: no such run directory under {out}")
        return run_dir
    if cfg.run_name and (out / cfg.run_name).is_dir():
        return out / cfg.run_name
    runs = sorted(p for p in out.iterdir() if p.is_dir() and latest_tag(p / "checkpoints")) if out.is_dir() else []
    if not runs:
        raise ConfigError(f"--resume: no run with a checkpoint under {out}; start a new run without --resume")
    return max(runs, key=lambda p: p.stat().st_mtime)
