# SPDX-License-Identifier: GPL-3.0-or-later
"""A node's declared inputs are the only ones it accepts, each within its widget's bounds, whatever the prompt.

ComfyUI hands a node every *linked* input of the prompt, declared or not, and checks a widget's min, max and
options only on values typed into it (not on linked ones, nor on inputs the node's ``validate_inputs`` names).
The nodes turn their inputs into run keys, so an undeclared input would set any run key (a VAE outside models/,
a secret) and a linked one could pass any number. ``CheckedNode`` checks every call of ``execute`` against the
node's own schema first: the schema is the allow-list.

A node that names the widgets it ``SHOWN``s declares every other widget input "advanced": the frontend folds them
(the node's "Show Advanced" menu entry), so a node opens with its essential settings only; folded widgets keep
their values, saved and queued as before.
"""
from __future__ import annotations

import functools
import inspect
import math

from comfy_api.latest import io

_CHECKED = "_pipetrain_checked"


def input_problem(spec, value) -> str | None:
    """What is wrong with ``value`` for the declared input ``spec``, or None (None values: an unlinked optional)."""
    if value is None:
        return None
    if isinstance(spec, io.Boolean.Input):
        return None if isinstance(value, bool) else "expected true or false"
    if isinstance(spec, (io.Int.Input, io.Float.Input)):
        number = isinstance(value, int) if isinstance(spec, io.Int.Input) else isinstance(value, (int, float))
        if isinstance(value, bool) or not number:
            return "expected a whole number" if isinstance(spec, io.Int.Input) else "expected a number"
        if isinstance(value, float) and not math.isfinite(value):
            return "expected a finite number"
        if spec.min is not None and value < spec.min or spec.max is not None and value > spec.max:
            return f"outside {spec.min} .. {spec.max}"
        return None
    if isinstance(spec, io.Combo.Input):
        return None if value in spec.options else "not one of the node's choices"
    if isinstance(spec, io.String.Input):
        return None if isinstance(value, str) else "expected text"
    return None     # PipeTrain's own socket types: ComfyUI links only a matching output to them


def check_declared(cls, values: dict) -> None:
    """ValueError naming the first input of ``values`` that ``cls``'s schema does not declare."""
    schema = cls.define_schema()
    declared = {spec.id for spec in schema.inputs}
    for name in values:
        if name not in declared:
            raise ValueError(f"{schema.display_name or schema.node_id}: {name!r} is not an input of this node; "
                             "remove the link to it (only the node's own inputs are used)")


def check_inputs(cls, values: dict) -> None:
    """ValueError naming the first input of ``values`` that ``cls``'s schema does not declare or bound."""
    check_declared(cls, values)
    schema = cls.define_schema()
    declared = {spec.id: spec for spec in schema.inputs}
    node = schema.display_name or schema.node_id
    for name, value in values.items():
        problem = input_problem(declared[name], value)
        if problem:
            shown = repr(value) if isinstance(value, (bool, int, float)) else "the value given"
            raise ValueError(f"{node}: input {name!r}: {shown} is refused ({problem}); set it on the "
                             "node's widget")


def fold_advanced(schema, shown: tuple[str, ...]):
    """``schema`` with every widget input whose id is not in ``shown`` declared advanced (the input's ``advanced``
    where ComfyUI has it, and in its extra options, which every ComfyUI passes on to the frontend)."""
    for spec in schema.inputs:
        if isinstance(spec, io.WidgetInput) and spec.id not in shown:
            spec.extra_dict = {**(spec.extra_dict or {}), "advanced": True}
            if hasattr(spec, "advanced"):
                spec.advanced = True
    return schema


class CheckedNode(io.ComfyNode):
    """A ComfyUI node whose ``execute`` sees only its declared inputs, within their bounds (``check_inputs``);
    with ``SHOWN`` (widget ids), its other widgets are advanced (``fold_advanced``)."""

    SHOWN: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        define = cls.__dict__.get("define_schema")
        if cls.__dict__.get("SHOWN") and define is not None and not getattr(define.__func__, _CHECKED, False):
            inner_schema = define.__func__

            @functools.wraps(inner_schema)
            def folded(klass):
                return fold_advanced(inner_schema(klass), klass.SHOWN)

            setattr(folded, _CHECKED, True)
            cls.define_schema = classmethod(folded)
        execute = cls.__dict__.get("execute")
        # ComfyUI clones node classes (their __dict__ copied): an execute already wrapped stays as it is
        if execute is None or getattr(execute.__func__, _CHECKED, False):
            return
        inner = execute.__func__
        signature = inspect.signature(inner)

        @functools.wraps(inner)
        def checked(klass, *args, **values):
            # a name the signature would refuse (no catch-all) is refused by name first, as any undeclared one is
            check_declared(klass, values)
            bound = signature.bind_partial(klass, *args, **values).arguments
            named = {}
            for name, param in list(signature.parameters.items())[1:]:
                if name in bound:
                    named.update(bound[name] if param.kind is param.VAR_KEYWORD else {name: bound[name]})
            check_inputs(klass, named)
            return inner(klass, *args, **values)

        setattr(checked, _CHECKED, True)
        cls.execute = classmethod(checked)
