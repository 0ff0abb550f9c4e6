# SPDX-License-Identifier: GPL-3.0-or-later
"""Where a widget starts: its key's config default (``backend/config``), the one place each default lives."""
from __future__ import annotations

from ..backend.config import DatasetConfig, DirectoryConfig
from ..backend.config.patch import choices, default

__all__ = ["DATASET", "DIRECTORY", "choices", "start"]
DATASET = DatasetConfig   # the dataset file's keys (``root`` of ``start``)
DIRECTORY = DirectoryConfig   # a [[directory]] table's own keys


def start(key: str, root=None, off=0):
    """The start value of the widget that sets ``key`` (dotted; ``root``: the dataset file's classes, else
    ``RunConfig``); ``off`` where the default leaves the key unset (the widget's value for "off")."""
    value = default(key, root)
    return off if value is None else value


def words(text) -> tuple[str, ...]:
    """The entries of a comma- (or semicolon-) separated text widget, stripped, empty ones dropped."""
    return tuple(w.strip() for w in str(text or "").replace(";", ",").split(",") if w.strip())
