"""Every config in examples/ is valid as shipped: run configs load, name a registered model type and a dataset
config beside them, and dataset configs load with their directories as written."""
from pathlib import Path

import pytest

from pipetrain.backend.config import load_dataset_config, load_run_config
from pipetrain.backend.models.registry import ADAPTERS

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RUNS = sorted(EXAMPLES.glob("*_lora.toml"))
DATASETS = sorted(set(EXAMPLES.glob("*.toml")) - set(RUNS))


def test_examples_cover_image_video_and_edit_models():
    types = {load_run_config(p).model.type for p in RUNS}
    assert {"flux", "sdxl", "wan", "qwen_image_edit"} <= types


@pytest.mark.parametrize("path", RUNS, ids=lambda p: p.name)
def test_example_run_config_loads(path):
    cfg = load_run_config(path)
    assert cfg.model.type in ADAPTERS
    assert Path(cfg.dataset).name in {p.name for p in DATASETS}


@pytest.mark.parametrize("path", DATASETS, ids=lambda p: p.name)
def test_example_dataset_config_loads(path):
    cfg = load_dataset_config(path)
    assert cfg.directory and all(d.path for d in cfg.directory)
