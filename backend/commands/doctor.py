# SPDX-License-Identifier: GPL-3.0-or-later
"""``python -m pipetrain doctor [--comfyui PATH] [--json] [--config run.toml]``: what a run would find on this machine.
With ``--comfyui`` given several times: every model type's verdict on each of those ComfyUIs, as one table (each
ComfyUI checked in a child process of its own: two cannot share one).

The ComfyUI found and its version, torch / CUDA / DeepSpeed, the GPUs and their memory, and every model type's
parity verdict on that ComfyUI (``parity/check.py``, memoised: a second call is instant); with ``--config run.toml``,
that run's memory plan on these GPUs (``memory/plan_config.py``).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import RuntimeSetupError


def _use_comfyui(path: str | None) -> None:
    """Point this process at ``path`` (before anything imports ComfyUI)."""
    if path is None:
        return
    root = Path(path).expanduser()
    if not (root / "comfy" / "model_management.py").is_file():
        raise RuntimeSetupError(f"--comfyui {path}: not a ComfyUI folder (no comfy/model_management.py in it); "
                                "give the folder that holds ComfyUI's main.py")
    os.environ["COMFYUI_PATH"] = str(root.resolve())


def environment() -> dict:
    """torch, CUDA, DeepSpeed and the GPUs this process sees."""
    import torch

    try:
        import deepspeed
        ds = deepspeed.__version__
    except Exception as e:  # noqa: BLE001  (reported, not raised: doctor describes a broken install too)
        ds = f"not importable ({type(e).__name__})"
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1)})
    return {"torch": torch.__version__, "cuda": torch.version.cuda if torch.cuda.is_available() else None,
            "deepspeed": ds, "gpus": gpus}


def report(comfyui: str | None = None, model_types: list[str] | None = None, config: str | None = None) -> dict:
    from ..host.runtime import locate_comfyui

    _use_comfyui(comfyui)
    locate_comfyui()   # no ComfyUI found: said now, before seconds of importing torch and DeepSpeed
    from ..parity import check as parity
    from ..models.registry import ADAPTERS
    from ..host.versions import comfyui_info, range_warning

    env = environment()
    info = comfyui_info()
    results = [parity.check_model_type(t) for t in (model_types or list(ADAPTERS))]
    data = {"comfyui": {**info, "warning": range_warning(info["version"])}, **env,
            "parity": [r.to_json() for r in results]}
    if config is not None:
        data["memory_plan"] = memory_plan_lines(config)
    return data


def memory_plan_lines(config: str) -> list[str]:
    """``config``'s memory plan on this machine's smallest GPU (or its memory_limit_gib)."""
    from ..config import load_run_config
    from ..memory.cli import gpu_total
    from ..memory.plan_config import plan_config

    cfg = load_run_config(config)
    return [f"memory plan of {config}:"] + plan_config(cfg, *gpu_total(cfg)).lines()


def format_report(data: dict) -> str:
    c = data["comfyui"]
    lines = [f"ComfyUI     {c['version']} at {c['path']} "
             f"({'tested' if c['tested'] else 'not tested'}; PipeTrain is tested with {c['tested_range']})",
             f"torch       {data['torch']}" + (f" (CUDA {data['cuda']})" if data["cuda"] else " (no CUDA)"),
             f"DeepSpeed   {data['deepspeed']}"]
    if data["gpus"]:
        lines += [f"GPU {g['index']}       {g['name']}, {g['memory_gib']} GiB" for g in data["gpus"]]
    else:
        lines.append("GPUs        none visible (training runs on the CPU)")
    if c["warning"]:
        lines.append(f"warning: {c['warning']}")
    width = max(len(r["model_type"]) for r in data["parity"])
    lines += ["", f"{'model type':<{width}}  parity on ComfyUI {c['version']}"]
    lines += [f"{r['model_type']:<{width}}  {r['summary']}" for r in data["parity"]]
    failed = [r for r in data["parity"] if not r["ok"]]
    lines.append("")
    lines.append(f"{len(data['parity']) - len(failed)} of {len(data['parity'])} model types train on this ComfyUI"
                 + (f"; a run of another type is refused before caching" if failed else ""))
    if data.get("memory_plan"):
        lines += [""] + data["memory_plan"]
    return "\n".join(lines)


def main(comfyui: str | None, as_json: bool, model_types: list[str] | None = None, config: str | None = None) -> int:
    import logging

    logging.getLogger().setLevel(logging.ERROR)   # ComfyUI's start-up chatter would bury the table
    data = report(comfyui, model_types, config)
    print(json.dumps(data) if as_json else format_report(data))   # JSON on one line: the last one
    return 0


def _verdicts_in_child(comfyui: str, model_types: list[str] | None) -> dict:
    """``doctor --json`` on one ComfyUI in a child process (this process's environment)."""
    import subprocess
    import sys

    from ..host.runtime import REPO_ROOT

    _use_comfyui(comfyui)   # the folder check, with its message
    argv = [sys.executable, str(REPO_ROOT / "__main__.py"), "doctor", "--json", "--comfyui", comfyui]
    for t in model_types or ():
        argv += ["--model-type", t]
    done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "COMFYUI_PATH": comfyui})
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
        raise RuntimeSetupError(f"doctor on {comfyui} failed (exit status {done.returncode}): {tail}")
    return json.loads(lines[-1])


def format_matrix(reports: list[dict]) -> str:
    """Model type x ComfyUI version: "passes" or the refusal's detail."""
    versions = [r["comfyui"]["version"] for r in reports]
    types = [p["model_type"] for p in reports[0]["parity"]]
    cells = {(r["comfyui"]["version"], p["model_type"]): ("passes" if p["ok"] else f"refused ({p['verdict']})")
             for r in reports for p in r["parity"]}
    width = max(len("model type"), *(len(t) for t in types))
    col = max(len("refused (differs)"), *(len(v) for v in versions))
    lines = [f"{'model type':<{width}}  " + "  ".join(f"{v:<{col}}" for v in versions)]
    lines += [f"{t:<{width}}  " + "  ".join(f"{cells.get((v, t), '-'):<{col}}" for v in versions) for t in types]
    for r in reports:
        passing = sum(p["ok"] for p in r["parity"])
        lines.append(f"ComfyUI {r['comfyui']['version']} ({r['comfyui']['path']}): {passing} of "
                     f"{len(r['parity'])} model types train")
    return "\n".join(lines)


def matrix_main(comfyuis: list[str], as_json: bool, model_types: list[str] | None = None) -> int:
    reports = [_verdicts_in_child(c, model_types) for c in comfyuis]
    print(json.dumps(reports) if as_json else format_matrix(reports))
    return 0
