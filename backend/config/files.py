"""Reading and writing the run and dataset files (TOML)."""
from __future__ import annotations

import sys
from pathlib import Path

import tomli_w

from .. import compat
from ..errors import ConfigError
from ..schema import from_dict, to_dict
from .dataset import DatasetConfig
from .run import RunConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError("file not found", file=path) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"not valid TOML: {e}", file=path) from None


def load_dataset_config(path: str | Path) -> DatasetConfig:
    path = Path(path).resolve()
    cfg = from_dict(DatasetConfig, _read_toml(path), file=path)
    cfg._base = path.parent
    return cfg


def load_run_config(path: str | Path, *, check_dataset: bool = True) -> RunConfig:
    path = Path(path).resolve()
    cfg = from_dict(RunConfig, _read_toml(path), file=path)
    cfg._file = path
    cfg.check_model_paths()
    if check_dataset:   # read once, here: a bad dataset file fails before anything starts
        cfg._dataset = load_dataset_config(cfg.resolve(cfg.dataset))
        has_control = any(d.control_path is not None for d in cfg._dataset.directory)
        cfg.model.type = compat.edit_type(cfg.model.type, has_control)
        cfg._evals = {e.name: load_dataset_config(cfg.resolve(e.config)) for e in cfg.eval_datasets}
    return cfg


def save_toml(obj, path: str | Path) -> None:
    """Write a config dataclass to TOML atomically."""
    from ..fsutil import atomic_write_bytes

    atomic_write_bytes(Path(path), tomli_w.dumps(to_dict(obj)).encode())

