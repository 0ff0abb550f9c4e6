"""``python -m pipetrain check-config run.toml``: what a config pair (diffusion-pipe's or ours) means here.

For each key of the main file and its dataset files: read as is, read under another name, accepted but
changing nothing, refused (with what to do), or unknown (a typo); then the defaults that differ from
diffusion-pipe's for the keys the files leave out; then what each model file's header says (``model_file_check``:
its model type or kind, or why it cannot train); then whether the pair loads, and the model type it trains.
Values are never printed (a config's values are the user's; the key names say enough), paths of model files are.
"""
from __future__ import annotations

import dataclasses
import sys
import typing
from pathlib import Path
from typing import get_args, get_origin

from ..config import DatasetConfig, RunConfig, compat
from ..config.common import config_path
from ..config.files import _read_toml
from ..config.patch import _section
from ..config.process_inputs import shown
from ..config.schema import ANY
from ..errors import PipeTrainError
from .model_file_check import check_model_files

_RENAMES = {"RunConfig": compat.RUN_RENAMES, "ModelConfig": compat.MODEL_RENAMES}


def _list_item_class(tp):
    """``list[DirectoryConfig]`` -> ``DirectoryConfig``; None for other types."""
    if get_origin(tp) is list:
        (inner,) = get_args(tp)[:1] or (None,)
        return inner if dataclasses.is_dataclass(inner) else None
    return None


def _key_lines(cls, data: dict, prefix: str = "", base: Path | None = None) -> list[str]:
    """One line per key of ``data`` (a table of ``cls``); ``base``: the folder of the file it is in (relative
    paths are read from it)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")}
    renames = _RENAMES.get(cls.__name__, {})
    unsupported = getattr(cls, "UNSUPPORTED", {})
    lines = []
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        target = renames.get(name, name)
        if name in compat.PATH_KEYS and base is not None and (where := _relative_paths(base, value)):
            lines.append(f"  {key}: {where}")
            if name in fields:
                continue   # otherwise read as is: this line says it all
        if cls.__name__ == "ModelConfig" and name == "flux_shift" and value is True and data.get("shift") is not None:
            lines.append(f"  {key}: not applied: shift is set, and a constant shift wins (diffusion-pipe's order)")
        elif isinstance(value, list) and target in compat.PER_RESOLUTION_KEYS and cls.__name__ == "RunConfig":
            lines.append(f"  {key}: a per-resolution list, read into {compat.PER_RESOLUTION_KEYS[target]} (each "
                         "bucket batches the entry nearest sqrt(width x height), as diffusion-pipe)")
        elif name in fields:
            section, items = _section(hints[name]), _list_item_class(hints[name])
            if section is not None and isinstance(value, dict):
                lines += _key_lines(section, value, key, base)
            elif items is not None and isinstance(value, list) and all(isinstance(v, dict) for v in value):
                for i, v in enumerate(value):
                    lines += _key_lines(items, v, f"{key}[{i}]", base)
            elif name == "type" and cls.__name__ == "ModelConfig" and value in compat.TYPE_ALIASES:
                lines.append(f"  {key}: diffusion-pipe's {shown(value)} is {compat.TYPE_ALIASES[value]!r} here")
            elif key in compat.MEANING_DIFFERENCES:
                lines.append(f"  {key}: DIFFERENT: {compat.MEANING_DIFFERENCES[key]}")
            else:
                lines.append(f"  {key}: read as is (diffusion-pipe's meaning where it has the key)")
        elif name in renames:
            lines.append(f"  {key}: read as {renames[name]}")
        elif (cls.__name__ == "ModelConfig" and name == "lumina_shift"
              and compat.TYPE_ALIASES.get(data.get("type"), data.get("type")) in compat.LUMINA_SHIFT_TYPES):
            lines.append(f"  {key}: read as flux_shift (the same resolution-dependent shift)")
        elif cls.__name__ == "ModelConfig" and name == "first_frame_conditioning_p":
            lines.append(f"  {key}: 1 trains type 'ltx_video_i2v' (every clip's first frame given), 0 plain "
                         "text to video; other values are refused")
        elif cls.__name__ == "ModelConfig" and name in compat.TEXT_ENCODER_KEYS:
            lines.append(f"  {key}: a text-encoder file, read into text_encoders (order: "
                         f"{', '.join(compat.TEXT_ENCODER_KEYS)})")
        elif cls.__name__ == "ModelConfig" and name in compat.FOLDER_KEYS:   # read or refused by model type
            model_type = compat.TYPE_ALIASES.get(data.get("type"), data.get("type"))
            lines.append(f"  {key}: {compat.model_folders.describe(name, model_type)}")
        elif name in unsupported:
            rule = unsupported[name]
            if rule.accepts(value) and rule.inert is ANY:
                lines.append(f"  {key}: accepted, changes nothing here ({rule.reason})")
            elif rule.accepts(value):
                lines.append(f"  {key}: accepted at this value, which changes nothing here")
            else:
                lines.append(f"  {key}: REFUSED: {rule.reason}")
        elif getattr(cls, "EXTRA_KEYS", False):
            lines.append(f"  {key}: passed to the optimizer's constructor")
        else:
            lines.append(f"  {key}: unknown key (a typo?); loading fails listing the accepted keys")
    return lines


def _relative_paths(base: Path, value) -> str | None:
    """Where a path key's relative paths are read from, when that is not where diffusion-pipe reads them (the
    working directory); None for absolute paths, or where the two are one folder."""
    values = value if isinstance(value, list) else [value]
    relative = [v for v in values if isinstance(v, str) and v and not Path(v).expanduser().is_absolute()]
    if not relative or base.resolve() == Path.cwd().resolve():
        return None
    if all(config_path(base, v) == Path.cwd() / v for v in relative):
        return ("DIFFERENT: a relative path, read from the working directory as diffusion-pipe reads it (nothing "
                "of that name beside this file)")
    return ("DIFFERENT: a relative path, read from this file's folder (diffusion-pipe: from the working "
            "directory; a path found only there is read from there)")


def _set_keys(data: dict, prefix: str = "") -> set[str]:
    out = set()
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        out.add(key)
        if isinstance(value, dict):
            out |= _set_keys(value, key)
    return out


def report(path: str | Path) -> tuple[str, bool]:
    """The report's text, and whether the pair loads."""
    from ..preflight import load_run

    path = Path(path).resolve()
    main = _read_toml(path)
    out = [f"{path}:"] + _key_lines(RunConfig, main, base=path.parent)
    raw_evals = main.get("eval_datasets")
    evals = [e.get("config") if isinstance(e, dict) else e for e in raw_evals] if isinstance(raw_evals, list) else []
    dataset_data = {}
    for i, dataset in enumerate([main.get("dataset"), *evals]):
        if not isinstance(dataset, str):
            continue
        dataset_path = config_path(path.parent, dataset).resolve()
        try:
            data = _read_toml(dataset_path)
        except PipeTrainError as e:
            out.append(str(e))
            continue
        out += [f"{dataset_path}:"] + _key_lines(DatasetConfig, data, base=dataset_path.parent)
        if i == 0:
            dataset_data = data
    given = {"main": _set_keys(main), "dataset": _set_keys(dataset_data)}
    differing = [(file, key, dp, ours) for file, key, dp, ours in compat.DEFAULT_DIFFERENCES
                 if not any(k.strip() in given[file] for k in key.split(","))
                 and (key.split(".")[0] in given[file] or "." not in key)]
    try:
        cfg, problem = load_run(path), None
    except PipeTrainError as e:
        cfg, problem = None, e
    if cfg is not None and (shift := model_shift(cfg)) is not None:
        differing.append(("main", "model.shift", "none (timesteps unshifted)", shift))
    te_rates = {"text_encoder_1_lr", "text_encoder_2_lr"} & set(main.get("model", {}) if isinstance(
        main.get("model"), dict) else {})
    if cfg is not None and cfg.model.type == "sdxl" and cfg.adapter is not None and not te_rates:
        differing.append(("main", "model.text_encoder_1_lr, text_encoder_2_lr", "[optimizer] lr (LoRAs on both text "
                          "encoders train)", "the text encoders stay frozen (diffusion-pipe's rate 0)"))
    if differing:
        out.append("Defaults that differ from diffusion-pipe's (keys these files leave out):")
        out += [f"  {key} ({file} file): diffusion-pipe {dp}; here {ours}" for file, key, dp, ours in differing]
    if problem is not None:
        out.append(f"Does not load: {problem}")
        return "\n".join(out), False
    raw_model = main.get("model") if isinstance(main.get("model"), dict) else {}
    findings = check_model_files(cfg, raw_model)
    out.append("Model files (their headers: no weights read, nothing unpickled):")
    out += [finding.line() for finding in findings]
    wrong = sum(finding.error is not None for finding in findings)
    if wrong:
        out.append(f"Does not load: {wrong} model file{'s' if wrong > 1 else ''} above {'are' if wrong > 1 else 'is'} "
                   "wrong (ERROR: what to change)")
        return "\n".join(out), False
    declared = raw_model.get("type")
    note = ""
    if declared in compat.EDIT_TYPES and cfg.model.type == compat.EDIT_TYPES[declared]:
        note = f" (diffusion-pipe's {declared!r} with control images: the dataset sets control_path)"
    elif declared in compat.FILE_TYPES and cfg.model.type != declared:
        from ..models.registry import arch_spec
        note = f" (diffusion-pipe's {declared!r} with a {arch_spec(cfg.model.type).title} file: its header says so)"
    out.append(f"Loads: trains model type {cfg.model.type!r}{note}.")
    return "\n".join(out), True


def model_shift(cfg) -> str | None:
    """The timestep shift the model trains with where its table sets neither ``shift`` nor ``flux_shift``
    (diffusion-pipe: none), said as check-config's defaults table says it; None where it trains unshifted."""
    from ..models.registry import adapter_class

    if cfg.model.shift is not None or cfg.model.flux_shift:
        return None
    objective = adapter_class(cfg.model.type)(cfg.model, cfg.resolve).objective()
    shift = getattr(objective, "shift_text", lambda: None)()   # None: no timestep shift (SDXL's discrete schedule)
    return None if shift is None else (f"{shift} ({cfg.model.type!r} trains as ComfyUI samples it; shift = 1 trains "
                                      "unshifted, as diffusion-pipe)")


def main(path: str) -> int:
    text, ok = report(path)
    print(text, file=sys.stdout)
    return 0 if ok else 1
