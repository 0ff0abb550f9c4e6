"""Dataclass <-> TOML-table conversion with strict checking.

Every unknown key, wrong type or value outside a ``Literal`` is reported with the file and the dotted
key, together with the accepted keys or values.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from ..errors import ConfigError


def _type_name(tp) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (list, tuple):
        args = get_args(tp)
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp) if a is not type(None))
    if dataclasses.is_dataclass(tp):
        return "table"
    return getattr(tp, "__name__", str(tp))


# the TOML types checked as they are, and how an error names them
_PLAIN = {bool: "true or false", str: "a string", dict: "a table"}


def _convert(value: Any, tp, file, key: str):
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        options = [a for a in get_args(tp) if a is not type(None)]
        if value is None:
            return None
        if len(options) == 1:  # Optional[X]: X's own message is the precise one
            return _convert(value, options[0], file, key)
        errors = []
        for option in options:
            try:
                return _convert(value, option, file, key)
            except ConfigError as e:
                errors.append(e)
        raise ConfigError(f"got {value!r}; expected {_type_name(tp)}", file=file, key=key)
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(
                f"got {value!r}; accepted values: {', '.join(repr(a) for a in allowed)}", file=file, key=key)
        return value
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise ConfigError(f"got {value!r}; expected {_type_name(tp)}", file=file, key=key)
        (inner,) = get_args(tp)[:1] or (Any,)
        return [_convert(v, inner, file, f"{key}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"got {value!r}; expected a table", file=file, key=key)
        return from_dict(tp, value, file=file, prefix=key)
    if tp is Any:
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"got {value!r}; expected a number", file=file, key=key)
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"got {value!r}; expected an integer", file=file, key=key)
        return value
    if tp in _PLAIN:
        if not isinstance(value, tp):
            raise ConfigError(f"got {value!r}; expected {_PLAIN[tp]}", file=file, key=key)
        return value
    raise TypeError(f"unsupported config type {tp!r} for {key}")


@dataclasses.dataclass(frozen=True)
class Unsupported:
    """A key another trainer (diffusion-pipe) accepts that PipeTrain does not act on.

    ``inert``: values that change nothing here, accepted and dropped (a callable, or values compared
    with ==; ``ANY`` accepts every value). Any other value fails with ``reason`` (what to do instead).
    """
    reason: str
    inert: Any = ()

    def accepts(self, value) -> bool:
        if self.inert is ANY:
            return True
        if callable(self.inert):
            return bool(self.inert(value))
        return any(value == v and type(value) is type(v) for v in self.inert)


ANY = object()


def from_dict(cls, data: dict, *, file=None, prefix: str = ""):
    """Build dataclass ``cls`` from a TOML table, rejecting unknown keys and wrong types.

    Class attributes a config class may set: ``UNSUPPORTED`` ({key: Unsupported}) for known keys
    PipeTrain does not support (distinct from typos, which list the accepted keys); ``preprocess(data,
    file, prefix)`` (a classmethod) to rewrite aliases and reject unsupported forms before checking;
    ``EXTRA_KEYS = True`` to collect the remaining keys into the ``_extra`` dict (passed on elsewhere).
    """
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")}
    data = dict(data)
    if hasattr(cls, "preprocess"):
        data = cls.preprocess(data, file, prefix)
    for name, rule in getattr(cls, "UNSUPPORTED", {}).items():
        if name in data and name not in fields:
            if not rule.accepts(data[name]):
                key = f"{prefix}.{name}" if prefix else name
                raise ConfigError(f"got {data[name]!r}; not supported by PipeTrain: {rule.reason}", file=file, key=key)
            del data[name]
    unknown = [k for k in data if k not in fields]
    extra = {}
    if unknown and getattr(cls, "EXTRA_KEYS", False):
        extra, unknown = {k: data.pop(k) for k in unknown}, []
    if unknown:
        key = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise ConfigError(
            f"unknown key; accepted keys{' in [' + prefix + ']' if prefix else ''}: {', '.join(sorted(fields))}",
            file=file, key=key)
    kwargs = {}
    for name, field in fields.items():
        key = f"{prefix}.{name}" if prefix else name
        if name in data:
            kwargs[name] = _convert(data[name], hints[name], file, key)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError("required key is missing", file=file, key=key)
    obj = cls(**kwargs)
    if getattr(cls, "EXTRA_KEYS", False):
        obj._extra = extra
    check = getattr(obj, "validate", None)
    if check is not None:
        check(file)
    return obj


# A field whose metadata holds ``SECRET`` (``field(metadata=secret())``: an API key) is read from a config but never
# written back: files PipeTrain writes (run.toml, the copy beside each LoRA) are shared and listed in the UI.
SECRET = "secret"


def secret() -> dict:
    return {SECRET: True}


def secret_keys(cls, prefix: str = "") -> list[str]:
    """The dotted keys of ``cls``'s tree (tables descended into) whose fields are secret."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        if f.metadata.get(SECRET):
            out.append(key)
            continue
        tp = hints[f.name]
        inner = [a for a in get_args(tp) if a is not type(None)] if get_origin(tp) in (Union, types.UnionType) else [tp]
        if len(inner) == 1 and dataclasses.is_dataclass(inner[0]):
            out += secret_keys(inner[0], key)
    return out


def to_dict(obj) -> dict:
    """Dataclass -> TOML-ready dict (``None`` dropped, paths as strings, private and secret fields skipped)."""
    out = {}
    for f in dataclasses.fields(obj):
        if f.name.startswith("_") or not f.init or f.metadata.get(SECRET):
            continue
        value = getattr(obj, f.name)
        value = _plain(value)
        if value is not None:
            out[f.name] = value
    if getattr(obj, "EXTRA_KEYS", False):
        out.update({k: _plain(v) for k, v in obj._extra.items()})
    return out


def _plain(value):
    if dataclasses.is_dataclass(value):
        return to_dict(value)
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
