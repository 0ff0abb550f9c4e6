"""Shared fixtures: random-initialised model files written once per machine, generated datasets, and
real DeepSpeed runs of the CLI."""
from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipetrain.backend.demo import make_dataset, write_configs
from pipetrain.backend.launch import deepspeed_command

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def micro_flux_files():
    from pipetrain.backend.models.tiny import cached_model_files
    return cached_model_files("flux", "micro")


@pytest.fixture(scope="session")
def tiny_flux_files():
    from pipetrain.backend.models.tiny import cached_model_files
    return cached_model_files("flux", "tiny")


@pytest.fixture(scope="session")
def tiny_sdxl_files():
    from pipetrain.backend.models.tiny import cached_model_files
    return cached_model_files("sdxl", "tiny")


@pytest.fixture(scope="session")
def model_files():
    """``model_files(arch, size="tiny")``: random-initialised files of any registered architecture, written
    once per machine (``.work/tiny-models``)."""
    from pipetrain.backend.models.tiny import cached_model_files
    return cached_model_files


@dataclass
class Run:
    returncode: int
    output: str
    output_dir: Path

    @property
    def run_dirs(self) -> list[Path]:
        return sorted(p for p in self.output_dir.iterdir() if (p / "status.json").exists())

    @property
    def run_dir(self) -> Path:
        return self.run_dirs[-1]

    def events(self, type_: str | None = None) -> list[dict]:
        lines = (self.run_dir / "events.jsonl").read_text().splitlines()
        events = [json.loads(line) for line in lines if line.strip()]
        return [e for e in events if type_ is None or e["type"] == type_]

    def status(self) -> dict:
        return json.loads((self.run_dir / "status.json").read_text())

    def losses(self) -> list[float]:
        return [e["loss"] for e in self.events("step")]

    def loras(self) -> list[Path]:
        return [Path(e["path"]) for e in self.events("lora_saved")]


def launch(config: Path, ranks: int, *extra: str, command: str = "train") -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(deepspeed_command(command, config, ranks, list(extra)) + ["--no-progress"],
                            cwd=config.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)


def train(config: Path, ranks: int, *extra: str, timeout: float = 900) -> Run:
    proc = launch(config, ranks, *extra)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"training timed out after {timeout} s\n{out[-5000:]}")
    root = config.parent
    return Run(proc.returncode, out, root / "output")


@pytest.fixture
def make_run(tmp_path):
    """Write a dataset and a run config into a fresh folder; returns the config path."""
    def _make(files, images: int = 8, name: str = "job", **overrides) -> Path:
        root = tmp_path / name
        make_dataset(root / "dataset", images)
        return write_configs(root, files, **overrides)
    return _make
