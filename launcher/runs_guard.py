# SPDX-License-Identifier: GPL-3.0-or-later
"""Keep ComfyUI's file routes out of the runs folder.

ComfyUI serves its ``input``, ``temp`` and ``output`` folders to anyone who can reach the server: ``POST
/upload/image`` (and ``/upload/mask``) writes any file under any name there (``type=output&subfolder=…``), and
``GET /view`` reads any file back. The runs folder lies in ``output`` and holds what a Resume executes
(``run.toml``, DeepSpeed checkpoints: pickles that DeepSpeed loads with ``torch.load``; the launcher's working
folder, which DeepSpeed's multi-node runner puts on every rank's ``PYTHONPATH``) and what a run knows (its
config and log, the cache's latents, which decode back into the dataset's images). So one upload there plus a
Resume would run the uploader's code, and ``/view`` would hand out the dataset. This middleware answers both 403
before ComfyUI's handler runs; everything else passes untouched (aiohttp keeps a parsed form for the handler).
PipeTrain's own routes serve what the panel needs (a run's state, its announced sample images).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from aiohttp import web

UPLOAD_ROUTES = ("/upload/image", "/upload/mask")
VIEW_ROUTES = ("/view",)


def upload_target(folders: Callable[[str], str | None], form) -> Path | None:
    """Where ComfyUI's ``image_upload`` would write this form's file (its own rules), or None without one."""
    filename = getattr(form.get("image"), "filename", None)
    upload_dir = folders(form.get("type") or "input")
    if not filename or upload_dir is None:
        return None
    folder = os.path.join(upload_dir, os.path.normpath(form.get("subfolder") or ""))
    return Path(os.path.abspath(os.path.join(folder, filename)))


def view_target(folders: Callable[[str], str | None], query) -> Path | None:
    """The file ComfyUI's ``/view`` would read for this query (its own rules: an ``[output]``-style suffix on
    the name picks the folder, the name's last part counts), or None."""
    name = query.get("filename") or ""
    base = None
    for kind in ("output", "input", "temp"):
        if name.endswith(f"[{kind}]"):
            name, base = name[:-len(kind) - 3], folders(kind)
    base = base or folders(query.get("type") or "output")
    if not name or base is None:
        return None
    return Path(os.path.abspath(os.path.join(base, query.get("subfolder") or "", os.path.basename(name))))


def inside(path: Path, folder: Path) -> bool:
    """``path`` is ``folder`` or lies in it, symbolic links followed as far as they exist."""
    path, folder = Path(os.path.realpath(path)), Path(os.path.realpath(folder))
    return path == folder or folder in path.parents


def runs_folder_guard(protected: Callable[[], list[Path]], folders: Callable[[str], str | None]):
    """An aiohttp middleware refusing uploads into, and views of, the folders ``protected()``."""
    @web.middleware
    async def guard(request: web.Request, handler):
        path = request.path.rstrip("/")
        target = None
        if request.method == "POST" and path.endswith(UPLOAD_ROUTES):
            target = upload_target(folders, await request.post())
        elif request.method in ("GET", "HEAD") and path.endswith(VIEW_ROUTES):
            target = view_target(folders, request.rel_url.query)
        if target is not None and any(inside(target, p) for p in protected()):
            return web.json_response({"error": "PipeTrain's runs folder is not served or written through ComfyUI's "
                                               "file routes: it holds the configs and checkpoints a Resume runs and "
                                               "the cached latents of the dataset"}, status=403)
        return await handler(request)
    return guard
