"""Reading and writing the run and dataset files (TOML)."""
from __future__ import annotations

import sys
from pathlib import Path

import tomli_w

from . import compat
from ..errors import ConfigError
from .schema import from_dict, secret_keys, to_dict
from .dataset import DatasetConfig
from .run import RunConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


MAX_CONFIG = 4 * 1024 * 1024   # a run or dataset file lists keys and folders; anything larger is not one


def _read_toml(path: Path, *, named_in=None, key: str | None = None) -> dict:
    """A TOML file's table; ``named_in`` and ``key``: the file and key that name ``path`` (the run file's
    ``dataset``), which the refusal then names."""
    from ..fsutil import UnreadableFile, read_regular
    where = dict(file=path) if named_in is None else dict(file=named_in, key=key)
    try:
        data = read_regular(path, MAX_CONFIG)
    except UnreadableFile as e:
        problem = "file not found" if e.missing else f"not read: {e}; name a TOML config file"
        raise ConfigError(problem if named_in is None else f"{path}: {problem}", **where) from None
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError("not UTF-8 text; name a TOML config file", **where) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"not valid TOML: {e}", file=path) from None


def load_dataset_config(path: str | Path, *, named_in=None, key: str | None = None) -> DatasetConfig:
    path = Path(path).resolve()
    cfg = from_dict(DatasetConfig, _read_toml(path, named_in=named_in, key=key), file=path)
    cfg._base = path.parent
    return cfg


def load_run_config(path: str | Path, *, check_dataset: bool = True) -> RunConfig:
    path = Path(path).resolve()
    cfg = from_dict(RunConfig, _read_toml(path), file=path)
    cfg._file = path
    cfg.check_model_paths()
    if cfg.model.diffusion_model:   # diffusion-pipe's type strings that the file decides (its Flux 2 type for Klein)
        cfg.model.type = compat.file_type(cfg.model.type, cfg.resolve(cfg.model.diffusion_model))
    if check_dataset:   # read once, here: a bad dataset file fails before anything starts
        cfg._dataset = load_dataset_config(cfg.resolve(cfg.dataset), named_in=path, key="dataset")
        has_control = any(d.control_path is not None for d in cfg._dataset.directory)
        cfg.model.type = compat.edit_type(cfg.model.type, has_control)
        cfg._evals = {e.name: load_dataset_config(cfg.resolve(e.config), named_in=path,
                                                  key=f"eval_datasets[{i}].config")
                      for i, e in enumerate(cfg.eval_datasets)}
    return cfg


def save_toml(obj, path: str | Path) -> None:
    """Write a config dataclass to TOML atomically."""
    from ..fsutil import atomic_write_bytes

    atomic_write_bytes(Path(path), tomli_w.dumps(to_dict(obj)).encode())


def without_secrets(run_toml: str) -> str:
    """A run file's text for a copy others see (beside each LoRA): as written, less its secret keys (an API
    key in a run.toml written by hand)."""
    table = tomllib.loads(run_toml)
    found = False
    for key in secret_keys(RunConfig):
        *parents, leaf = key.split(".")
        node = table
        for name in parents:
            node = node.get(name) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node:
            del node[leaf]
            found = True
    return tomli_w.dumps(table) if found else run_toml
