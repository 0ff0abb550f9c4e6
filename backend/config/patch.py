"""Run keys set a few at a time: what each PipeTrain node contributes to the run and dataset files.

A ``RunPatch`` holds (dotted key, value) pairs named as in the TOML files (``epochs``, ``optimizer.lr``,
``adapter.rank``); lists travel as tuples, so a patch is frozen and hashable and ComfyUI can cache a node's
output on it. Patches merge into one table that the config classes validate once. A key nobody sets takes
its config field's default, which is also the default of the widget that sets it (``default``): each default
lives in one place, the field.
"""
from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass
from typing import Any, Mapping, Union, get_args, get_origin

# A field whose default is "unset" (the key left out: e.g. the optimizer constructor's own default) names the
# value its widget shows in its metadata, ``field(default=None, metadata=widget(0.01))``: a widget cannot show
# "unset", and the value the user sees is then written out.
WIDGET = "widget"


def widget(value) -> dict:
    return {WIDGET: value}


def _frozen(value):
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        raise TypeError("flatten tables into dotted keys")
    return value


def _plain(value):
    return [_plain(v) for v in value] if isinstance(value, tuple) else value


@dataclass(frozen=True)
class RunPatch:
    items: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, keys: Mapping[str, Any], prefix: str = "") -> "RunPatch":
        """``{"rank": 8}`` with ``prefix="adapter"`` -> ``adapter.rank = 8``; a value of None leaves the key out
        (its default applies); a table value becomes dotted keys."""
        flat: dict[str, Any] = {}
        for key, value in keys.items():
            name = f"{prefix}.{key}" if prefix else key
            if isinstance(value, dict):
                flat.update(cls.of(value, name).as_dict())
            elif value is not None:
                flat[name] = _frozen(value)
        return cls(tuple(sorted(flat.items())))

    def as_dict(self) -> dict[str, Any]:
        return dict(self.items)

    def get(self, key: str, default=None):
        return self.as_dict().get(key, default)

    def __or__(self, other: "RunPatch") -> "RunPatch":
        """Both patches' keys; ``other``'s value where both set one."""
        return RunPatch(tuple(sorted((self.as_dict() | other.as_dict()).items())))

    def table(self) -> dict:
        """The nested TOML table (tuples as lists)."""
        out: dict = {}
        for key, value in self.items:
            *parents, leaf = key.split(".")
            node = out
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = _plain(value)
        return out


def _section(tp):
    """The config class a field's type holds (``Optional[AdapterConfig]`` -> ``AdapterConfig``), or None."""
    if get_origin(tp) is Union:
        inner = [a for a in get_args(tp) if a is not type(None)]
        tp = inner[0] if len(inner) == 1 else None
    return tp if dataclasses.is_dataclass(tp) else None


@functools.lru_cache(maxsize=None)
def _resolve(root, key: str) -> tuple[type, dataclasses.Field]:
    """The config class that holds ``key`` (dotted) under ``root``, and the key's field. Memoised: the nodes'
    schemas ask it for every widget, and ComfyUI builds a node's schema each time it validates one, on its event
    loop (``typing.get_type_hints`` takes milliseconds: a prompt of many nodes held every request up)."""
    if root is None:
        from .run import RunConfig
        root = RunConfig
    cls = root
    *parents, leaf = key.split(".")
    for name in parents:
        cls = _section(typing.get_type_hints(cls)[name])
        if cls is None:
            raise KeyError(f"{key}: {name} is not a table")
    for f in dataclasses.fields(cls):
        if f.name == leaf:
            return cls, f
    raise KeyError(f"{key}: no such key in {cls.__name__}")


def default(key: str, root=None):
    """The default of ``key`` (dotted, e.g. ``optimizer.lr``) under ``root`` (``RunConfig``): what a widget
    that sets it starts at."""
    _, f = _resolve(root, key)
    if WIDGET in f.metadata:
        return f.metadata[WIDGET]
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    if f.default is dataclasses.MISSING:
        raise KeyError(f"{key} is required: it has no default")
    return f.default


def choices(key: str, root=None) -> list:
    """The values a ``Literal`` key accepts (``Optional`` unwrapped), for a combo."""
    return list(_choices(root, key))


@functools.lru_cache(maxsize=None)
def _choices(root, key: str) -> tuple:
    """``choices``, memoised as ``_resolve`` is."""
    cls, f = _resolve(root, key)
    tp = typing.get_type_hints(cls)[f.name]
    if get_origin(tp) is Union:
        (tp,) = [a for a in get_args(tp) if a is not type(None)]
    if get_origin(tp) is not typing.Literal:
        raise KeyError(f"{key} is not one of fixed values")
    return get_args(tp)


def leaf_keys(root) -> list[str]:
    """Every key of ``root``'s tree, dotted, descending into its tables (not into lists of tables)."""
    hints = typing.get_type_hints(root)
    out = []
    for f in dataclasses.fields(root):
        if f.name.startswith("_"):
            continue
        section = _section(hints[f.name])
        out += [f"{f.name}.{k}" for k in leaf_keys(section)] if section else [f.name]
    return out
