# SPDX-License-Identifier: GPL-3.0-or-later
"""The guard every patch of a host library (ComfyUI: ``host/patches_comfyui.py``, DeepSpeed:
``train/patches_deepspeed.py``) runs before it replaces anything: the attribute is there and takes the arguments the
replacement was written for. A host upgrade that moved or changed it then stops the run with an error naming the host,
its version and the attribute, instead of a replacement silently running against code it no longer matches."""
from __future__ import annotations

import inspect
from typing import Callable

from ..errors import RuntimeSetupError


def require(host: str, version: Callable[[], str], owner, name: str, params: tuple | None = None):
    """``owner.name`` (an attribute of a class, a module or an object), checked: it exists and, with ``params``, is
    a callable whose parameter names are exactly those (or exactly one of several such tuples, where releases
    differ and the replacement takes each). Returns it. ``version`` is read only for the error."""
    cls = owner if isinstance(owner, type) else type(owner)
    where = owner.__name__ if inspect.ismodule(owner) else f"{cls.__module__}.{cls.__qualname__}"
    found = getattr(owner, name, None)
    if found is None:
        raise _mismatch(host, version, f"{where}.{name} does not exist")
    if params is not None:
        try:
            have = tuple(inspect.signature(found).parameters)
        except (TypeError, ValueError):
            raise _mismatch(host, version, f"{where}.{name} is not a function") from None
        accepted = [tuple(p) for p in params] if params and isinstance(params[0], tuple) else [tuple(params)]
        if have not in accepted:
            written = " or ".join(f"({', '.join(p)})" for p in accepted)
            raise _mismatch(host, version, f"{where}.{name} takes ({', '.join(have)}), PipeTrain's replacement was "
                                           f"written for {written}")
    return found


def replacement_params(replacement, bound: int) -> tuple[str, ...]:
    """The parameter names ``replacement`` leaves to its caller once its first ``bound`` ones are bound."""
    return tuple(inspect.signature(replacement).parameters)[bound:]


def _mismatch(host: str, version: Callable[[], str], what: str) -> RuntimeSetupError:
    return RuntimeSetupError(
        f"{host} {version()}: {what}. PipeTrain patches this part of {host} and will not run against code it does not "
        f"match: install the {host} version PipeTrain is tested with (see docs/models.md), or update PipeTrain")
