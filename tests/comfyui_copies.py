"""Other ComfyUIs for the tests: the extra versions scripts/setup.sh extracts beside the pinned one
(``.comfyui/ComfyUI-<version>``), the newer ones kept in the machine's ComfyUI cache (``comfyui_cache()``:
``<version>/`` trees and their extra packages in ``<version>-site/``, written by scripts/comfyui_cache.sh), and
temporary copies of a ComfyUI with one line of its model code changed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# the ComfyUIs after the pinned one that the tests cover where the machine's cache holds them
NEWER_VERSIONS = ("0.8.0", "0.33.0")


def comfyui_cache() -> Path:
    """Where the newer ComfyUIs live on this machine, outside the repository (``PIPETRAIN_COMFYUI_CACHE``)."""
    return Path(os.environ.get("PIPETRAIN_COMFYUI_CACHE") or Path.home() / ".cache" / "pipetrain" / "comfyui")


def _is_comfyui(p: Path) -> bool:
    return (p / "comfy" / "model_management.py").is_file()


def other_comfyuis() -> dict[str, Path]:
    """version -> folder of every ComfyUI beside the pinned one (``.comfyui/ComfyUI-<version>`` and the cache's)."""
    found = {p.name.removeprefix("ComfyUI-"): p for p in sorted((REPO / ".comfyui").glob("ComfyUI-*"))
             if _is_comfyui(p)}
    found.update({v: comfyui_cache() / v for v in NEWER_VERSIONS if _is_comfyui(comfyui_cache() / v)})
    return found


def missing_newer_versions() -> list[str]:
    return [v for v in NEWER_VERSIONS if not _is_comfyui(comfyui_cache() / v)]


def extra_packages(comfyui: Path) -> Path | None:
    """The folder of the packages a cached ComfyUI needs beyond the suite's venv (comfy-kitchen & co.), also for
    a planted copy of it (whose main.py links to the original)."""
    for tree in (comfyui, (comfyui / "main.py").resolve().parent):
        site = tree.parent / f"{tree.name}-site"
        if site.is_dir():
            return site
    return None


def planted_copy(source: Path, dest: Path, file: str, old: str, new: str, occurrences: int = 1) -> Path:
    """``source`` with ``comfy/`` copied (everything else linked) and ``old`` replaced by ``new`` in ``file``
    (where it occurs exactly ``occurrences`` times)."""
    import shutil

    dest.mkdir(parents=True)
    for entry in source.iterdir():
        if entry.name == "comfy":
            shutil.copytree(entry, dest / "comfy", ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (dest / entry.name).symlink_to(entry.resolve())
    target = dest / file
    text = target.read_text()
    assert text.count(old) == occurrences, f"{file} changed upstream: the planted line is not there as expected"
    target.write_text(text.replace(old, new))
    return dest


def python_env(comfyui: Path, **extra: str) -> dict:
    """The environment of a child process that imports ``comfyui`` (and this checkout as ``pipetrain``)."""
    env = {**os.environ, "COMFYUI_PATH": str(comfyui), "PYTHONUNBUFFERED": "1", **extra}
    site = extra_packages(comfyui)
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(site), env.get("PYTHONPATH"))))
    return env


def doctor(comfyui: Path, *model_types: str, timeout: float = 600, warm: bool = False, **env: str) -> dict:
    """``python -m pipetrain doctor --json`` on ``comfyui`` in a child process (ComfyUI imports once per process);
    ``warm``: forked from that ComfyUI's warm server (``conftest.python_child``: where other tests of the file use it,
    not for a one-off copy)."""
    argv = ["doctor", "--json", "--comfyui", str(comfyui)]
    for t in model_types:
        argv += ["--model-type", t]
    if warm:
        from conftest import last_json, python_child

        out = python_child(argv, python_env(comfyui, **env), timeout=timeout)
        assert out.returncode == 0, out.stderr[-3000:]
        return last_json(out.stdout)
    out = subprocess.run([sys.executable, "-m", "pipetrain", *argv], capture_output=True, text=True, timeout=timeout,
                         env=python_env(comfyui, **env))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def newer_comfyui(version: str) -> Path:
    """The cached ComfyUI ``version``; the test is skipped, saying how to get it, where the cache lacks it."""
    import pytest

    found = other_comfyuis().get(version)
    if found is None:
        pytest.skip(f"ComfyUI {version} is not in {comfyui_cache()} (scripts/comfyui_cache.sh writes it)")
    return found


def child_json(code: str, comfyui: Path, *args: str, timeout: float = 600) -> dict:
    """``code`` in a Python importing ``comfyui``, forked from that ComfyUI's warm server (``conftest.python_child``:
    the imports paid once; its callers' files train on that ComfyUI too); its last line of JSON."""
    from conftest import last_json, python_child

    out = python_child(list(args), python_env(comfyui), code=code, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return last_json(out.stdout)


# a child's check of epoch LoRAs (argv: the run's config, then the LoRA files) by that ComfyUI's own loader
CHECK_LORAS = """
import json, sys
from pathlib import Path
from pipetrain.backend.config import load_run_config
from pipetrain.backend.host.runtime import comfyui_version
from pipetrain.backend.parity.verify import check_loras
cfg = load_run_config(sys.argv[1])
checks = [c.__dict__ for c in check_loras(cfg, [Path(p) for p in sys.argv[2:]])]
print(json.dumps({"version": comfyui_version(), "type": cfg.model.type, "checks": checks}))
"""


def tiny_files_code(model_type: str) -> str:
    """The start of a child's code that writes (once per machine) the tiny files of ``model_type`` with the ComfyUI it
    imports and puts their paths in ``out["files"]``; ``files`` and ``loading`` are in scope after it."""
    return f"""
import json, sys, torch
from pipetrain.backend.models import loading
from pipetrain.backend.models.tiny import cached_model_files
files = cached_model_files({model_type!r})
out = {{"files": {{"diffusion_model": str(files.diffusion_model), "vae": str(files.vae),
                 "text_encoders": [str(p) for p in files.text_encoders]}}}}
"""


def ranks_import(comfyui: Path, monkeypatch, memo: Path) -> None:
    """The ranks a test starts import ``comfyui`` (and its extra packages), memoising parity verdicts in ``memo``."""
    for name, value in python_env(comfyui).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PIPETRAIN_PARITY_CACHE", str(memo))


def check_config_on(comfyui: Path, config: Path) -> str:
    """``pipetrain check-config`` of ``config`` in a Python importing ``comfyui``, forked from that ComfyUI's warm server
    (``conftest.python_child``: its callers' files train on it too): its output, the config loading."""
    from conftest import python_child

    checked = python_child(["check-config", str(config)], python_env(comfyui), timeout=300)
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]
    return checked.stdout


def check_two_epoch_run_on(comfyui: Path, version: str, run, config: Path, model_type: str, keys: int) -> None:
    """A finished 2-epoch run that trained ``model_type`` on ComfyUI ``version`` after its parity check passed, whose
    each epoch LoRA that ComfyUI's LoraLoaderModelOnly applies (``keys`` linears patched), reproducing the training
    side, with an effect."""
    from conftest import MATCH_TOLERANCE, MIN_EFFECT

    assert run.returncode == 0, run.output[-4000:]
    assert run.status()["state"] == "finished"
    assert run.events("start")[0]["comfyui"]["version"] == version
    (parity,) = run.events("parity")
    assert parity["model_type"] == model_type and parity["verdict"] == "passes", parity
    loras = run.loras()
    assert [e["epoch"] for e in run.events("lora_saved")] == [1, 2] and len(loras) == 2
    got = child_json(CHECK_LORAS, comfyui, str(config), *map(str, loras))
    assert got["version"] == version and got["type"] == model_type, got
    for check in got["checks"]:
        assert check["keys_loaded"] == keys, got
        assert check["comfy_vs_training"] < MATCH_TOLERANCE * max(1.0, check["scale"]), got
        assert check["lora_effect"] > MIN_EFFECT, got


# what a copy of the repository leaves out (as a user's clone has none of it)
NOT_COPIED = (".git", ".venv", ".comfyui", ".work", ".whl", ".bench", ".shim", "test-artifacts", "__pycache__",
              ".pytest_cache", "build", "*.egg-info")


def python_without_pipetrain(folder: Path, extra: Path | None = None) -> Path:
    """A fresh venv whose site-packages names this environment's (one ``.pth`` path line): every installed
    package but not the editable PipeTrain, whose ``.pth`` import line is only run in a site directory.
    ``extra``: a folder of packages named first (a newer ComfyUI's own, e.g. its frontend package, which
    must win over this environment's older one)."""
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(folder)],
                   check=True)
    python = folder / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    lines = ([str(extra)] if extra is not None else []) + [sysconfig.get_paths()["purelib"]]
    Path(site, "test_environment.pth").write_text("".join(line + "\n" for line in lines))
    return python
