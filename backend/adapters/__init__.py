"""The adapter kinds, by their ``[adapter] type``: each one module implementing ``base.AdapterKind``."""
from __future__ import annotations

from .base import AdapterKind, AdapterSpec
from .lokr import LoKrKind
from .loha import LoHaKind
from .lora import LoRA
from .oft import OFTKind

ADAPTERS: dict[str, AdapterKind] = {k.name: k for k in (LoRA(), LoKrKind(), LoHaKind(), OFTKind())}

__all__ = ["ADAPTERS", "AdapterKind", "AdapterSpec"]
