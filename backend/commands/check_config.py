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
from ..config.model import token_length_keys
from ..config.files import _read_toml
from ..config.patch import _section
from ..config.process_inputs import shown
from ..config.schema import ANY
from ..errors import PipeTrainError
from .model_file_check import check_model_files

_RENAMES = {"RunConfig": compat.RUN_RENAMES, "ModelConfig": compat.MODEL_RENAMES}
# [model] keys whose default differs from diffusion-pipe's for some model types (the report names them where a config
# trains such a type): key -> (diffusion-pipe, here)
MODEL_DEFAULTS = {
    "shift": ("none (timesteps unshifted)", "the model's own shift, as ComfyUI samples it (check-config names it; "
              "shift = 1 trains unshifted)"),
    "text_encoder_1_lr": ("[optimizer] lr (LoRAs on both text encoders train)",
                          "the text encoders stay frozen (diffusion-pipe's rate 0)"),
    "max_sequence_length": ("required (256 for AuraFlow, 768 for Pony V7)",
                            "ComfyUI's: every token of a caption, padded to 256"),
}
MODEL_DEFAULTS["text_encoder_2_lr"] = MODEL_DEFAULTS["text_encoder_1_lr"]


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
                if (cls.__name__ == "RunConfig" and name == "adapter" and "fuse_adapters" in value
                        and compat.reads_fuse_adapters((data.get("model") or {}).get("type"))):
                    lines.append(f"  {key}.fuse_adapters: {compat.FUSE_ADAPTERS_LINE}")
                    value = {k: v for k, v in value.items() if k != "fuse_adapters"}
                lines += _key_lines(section, value, key, base)
            elif items is not None and isinstance(value, list) and all(isinstance(v, dict) for v in value):
                for i, v in enumerate(value):
                    lines += _key_lines(items, v, f"{key}[{i}]", base)
            elif name == "type" and cls.__name__ == "ModelConfig" and value in compat.type_aliases():
                lines.append(f"  {key}: diffusion-pipe's {shown(value)} is {compat.type_aliases()[value]!r} here")
            elif key in compat.MEANING_DIFFERENCES:
                lines.append(f"  {key}: DIFFERENT: {compat.MEANING_DIFFERENCES[key]}")
            else:
                lines.append(f"  {key}: read as is (diffusion-pipe's meaning where it has the key)")
        elif name in renames:
            lines.append(f"  {key}: read as {renames[name]}")
        elif (cls.__name__ == "ModelConfig" and name == "lumina_shift"
              and compat.reads_lumina_shift(compat.type_aliases().get(data.get("type"), data.get("type")))):
            lines.append(f"  {key}: read as flux_shift (the same resolution-dependent shift)")
        elif cls.__name__ == "ModelConfig" and name == "first_frame_conditioning_p":
            given = compat.first_frame_types().get(compat.type_aliases().get(data.get("type"), data.get("type")))
            lines.append(f"  {key}: 1 trains type {given!r} (every clip's first frame given), 0 plain "
                         "text to video; other values are refused")
        elif (cls.__name__ == "ModelConfig" and name == "llama3_path"
              and compat.reads_llama3_path(compat.type_aliases().get(data.get("type"), data.get("type")))):
            lines.append(f"  {key}: DIFFERENT: a Hugging Face Llama folder, read into text_encoders after the others "
                         "as ComfyUI's Llama (its lm_head left out), which runs without Llama 3.1's RoPE scaling as "
                         "ComfyUI's own Llama 3.1 file does (diffusion-pipe: transformers' Llama, scaled)")
        elif cls.__name__ == "ModelConfig" and name in compat.TEXT_ENCODER_KEYS:
            lines.append(f"  {key}: a text-encoder file, read into text_encoders (order: "
                         f"{', '.join(compat.TEXT_ENCODER_KEYS)})")
        elif cls.__name__ == "ModelConfig" and name in compat.FOLDER_KEYS:   # read or refused by model type
            model_type = compat.type_aliases().get(data.get("type"), data.get("type"))
            lines.append(f"  {key}: {compat.model_folders.describe(name, model_type)}")
        elif cls.__name__ == "RunConfig" and name == "resume_from_checkpoint":
            lines.append(f"  {key}: read by the train command as its --resume_from_checkpoint (true: the newest run "
                         "of output_dir; a name: that run; the flag on the command line wins, as in diffusion-pipe)")
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
        differing.append(("main", "model.shift", MODEL_DEFAULTS["shift"][0], shift))
    te_rates = {"text_encoder_1_lr", "text_encoder_2_lr"} & set(main.get("model", {}) if isinstance(
        main.get("model"), dict) else {})
    if cfg is not None and dp_trains_text_encoders(cfg.model.type) and cfg.adapter is not None and not te_rates:
        differing.append(("main", "model.text_encoder_1_lr, text_encoder_2_lr", *MODEL_DEFAULTS["text_encoder_1_lr"]))
    length_key = token_length_keys().get(cfg.model.type) if cfg is not None else None
    if length_key in MODEL_DEFAULTS and getattr(cfg.model, length_key) is None:   # AuraFlow's: dp requires it
        differing.append(("main", f"model.{length_key}", *MODEL_DEFAULTS[length_key]))
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
    if declared in compat.edit_types() and cfg.model.type == compat.edit_types()[declared]:
        note = f" (diffusion-pipe's {declared!r} with control images: the dataset sets control_path)"
    elif declared in compat.file_types() and cfg.model.type != declared:
        from ..models.registry import arch_spec
        note = f" (diffusion-pipe's {declared!r} with a {arch_spec(cfg.model.type).title} file: its header says so)"
    out.append(f"Loads: trains model type {cfg.model.type!r}{note}.")
    return "\n".join(out), True


def dp_trains_text_encoders(model_type: str) -> bool:
    """Whether diffusion-pipe trains LoRAs on this model's text encoders by default (its adapter's
    ``dp_text_encoder_lora``: SDXL)."""
    from ..models.registry import dp_facts
    return model_type in dp_facts("dp_text_encoder_lora")


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


# --- docs/dp_keys.md: every key diffusion-pipe reads, and what it means here -------------------------------------
_TABLES = {"main": ("RunConfig", ""), "monitoring": ("MonitoringConfig", "monitoring"), "model": ("ModelConfig", "model"),
           "adapter": ("AdapterConfig", "adapter"), "optimizer": ("OptimizerConfig", "optimizer"),
           "dataset": ("DatasetConfig", ""), "directory": ("DirectoryConfig", "directory[0]")}
SAME = "same"
RELATIVE = ("a relative path is read from the TOML's folder, or from the working directory where only that holds it "
            "(diffusion-pipe: the working directory)")


def dp_key_line(table: str, key: str, value, dp_type: str | None = None) -> str:
    """What check-config says of diffusion-pipe's ``key`` in ``table`` (main, monitoring, model, adapter, optimizer,
    dataset, directory) at ``value`` (a [model] key in a table of ``dp_type``): "same" where it trains as in
    diffusion-pipe with its default, else the difference (its meaning, its default, where relative paths are
    read from)."""
    from .. import config

    name, prefix = _TABLES[table]
    cls = getattr(config, name)
    data = {key: value} if table != "model" or key == "type" else {"type": dp_type, key: value}
    shown = f"{prefix}.{key}" if prefix else key
    if (table, key) == ("adapter", "fuse_adapters"):   # read by model type, which the adapter table lacks
        line = f"  {shown}: {compat.FUSE_ADAPTERS_LINE} (for flux and chroma; diffusion-pipe's other models " \
               "ignore the key, as here)"
    else:
        line = next(l for l in _key_lines(cls, data, prefix) if l.startswith(f"  {shown}:"))
    said = line.split(": ", 1)[1]
    notes = []
    if said.startswith("accepted at this value"):
        rule = cls.UNSUPPORTED[key]
        said = f"accepted at {value!r}, which changes nothing here; another value is refused ({rule.reason})"
    elif said.startswith("read as is"):
        said = SAME
    elif said.startswith("read as "):
        said = f"{SAME} (here: {said[len('read as '):]})"
    file = "dataset" if table == "dataset" else "main"
    dotted = key if table in ("main", "dataset") else f"{table}.{key}"
    for row_file, keys, dp, ours in compat.DEFAULT_DIFFERENCES if table != "directory" else ():   # its dataset's
        if row_file == file and dotted in [k.strip() for k in keys.split(",")]:
            notes.append(f"left out: diffusion-pipe {dp}; here {ours}")
    if table == "model" and key in MODEL_DEFAULTS:
        notes.append("left out: diffusion-pipe {}; here {}".format(*MODEL_DEFAULTS[key]))
    if key in compat.PATH_KEYS and isinstance(value, (str, list)):
        notes.append(RELATIVE)
    if notes and said == SAME:
        said = "same value meaning"
    return "; ".join([said, *notes])


def dp_key_table(keys) -> str:
    """docs/dp_keys.md's body: a row per (table, key, value, dp type) of ``keys``."""
    rows = ["| table | key | here |", "|---|---|---|"]
    for table, key, value, dp_type in keys:
        where = f"{table} ({dp_type})" if dp_type and table == "model" and key != "type" else table
        rows.append(f"| {where} | `{key}` | {dp_key_line(table, key, value, dp_type).replace('|', '/')} |")
    return "\n".join(rows) + "\n"
