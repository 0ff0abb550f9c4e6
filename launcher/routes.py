# SPDX-License-Identifier: GPL-3.0-or-later
"""HTTP routes under ``/pipetrain``: list runs, one run, stop, resume, an epoch's sample images, and the requests
to a live run: save now, sample now, stop after this epoch (``stop_after_epoch``), a new learning rate (``lr``,
body ``{"lr": 1e-4}``).

Run ids are checked by ``backend.run.folder.check_run_id`` and the resolved folder must sit directly in the runs
root: a bad id is a 400, an unknown one a 404. State changes are POSTs whose body, if any, is a small JSON
object: anything else (not JSON, not an object, nested past what ``json`` can parse, larger than
``MAX_BODY``) is a 400 or 413 naming the problem, never a traceback, as is a value that can never be valid (a
learning rate that is not a finite number in range). A refused state change (a run not running) is a 409.
"""
from __future__ import annotations

import asyncio
import json
from typing import Callable

from aiohttp import web

from ..backend.run import control as run_control
from ..backend.errors import PipeTrainError
from ..backend.run.folder import RunIdError
from ..backend.sampling.audio import AUDIO_TYPES
from .core import Launcher
from .summaries import sample_file


MAX_BODY = 16 * 1024          # {"kill": true} or {"lr": 1e-4} is all a body carries


class BodyError(ValueError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


async def _body(request: web.Request) -> dict:
    """The POST body as a dict ({} when empty); ``BodyError`` for anything else."""
    if request.content_length is not None and request.content_length > MAX_BODY:
        raise BodyError(413, f"request body larger than {MAX_BODY} bytes")
    data = b""
    while len(data) <= MAX_BODY:          # read() may return less than asked: read to the end or past the limit
        chunk = await request.content.read(MAX_BODY + 1 - len(data))
        if not chunk:
            break
        data += chunk
    if len(data) > MAX_BODY:
        raise BodyError(413, f"request body larger than {MAX_BODY} bytes")
    if not data.strip():
        return {}
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):  # RecursionError: a deeply nested body
        raise BodyError(400, "request body is not a JSON object (send {} or {\"kill\": true})") from None
    if not isinstance(body, dict):
        raise BodyError(400, "request body must be a JSON object, e.g. {\"kill\": true}")
    return body


def add_routes(routes: web.RouteTableDef, get_launcher: Callable[[], Launcher]) -> None:
    def guarded(action):
        async def handler(request: web.Request) -> web.Response:
            run_id = request.match_info.get("run_id", "")
            try:
                body = await _body(request) if request.method == "POST" and request.can_read_body else {}
            except BodyError as e:
                return _error(e.status, str(e))
            args = dict(request.query) | body
            loop = asyncio.get_running_loop()
            try:  # file I/O and process waits stay off the event loop
                return web.json_response(await loop.run_in_executor(None, action, get_launcher(), run_id, args))
            except (RunIdError, run_control.ControlValueError) as e:
                return _error(400, str(e))
            except KeyError:
                return _error(404, f"no run {run_id!r}")
            except PipeTrainError as e:
                return _error(409, str(e))
            except (OSError, ValueError, TypeError, AttributeError) as e:
                # a run folder holding what PipeTrain never wrote there: named, its content never quoted
                return _error(409, f"run {run_id!r}: its folder cannot be read as a run ({type(e).__name__})")
        return handler

    @routes.get("/pipetrain/runs")
    async def list_runs(request: web.Request) -> web.Response:
        # each run's files are read: off the event loop, which serves every other route and the websocket
        runs = await asyncio.get_running_loop().run_in_executor(None, get_launcher().list)
        return web.json_response({"runs": runs})

    def get_run(launcher, run_id, args):
        return launcher.get(run_id)

    def stop_run(launcher, run_id, args):
        return launcher.stop(run_id, kill=args.get("kill") in (True, 1, "1", "true"))

    def resume_run(launcher, run_id, args):
        launcher.resume(run_id)
        return launcher.get(run_id) | {"events": []}

    @routes.get("/pipetrain/runs/{run_id}/samples/{name}")
    async def get_sample(request: web.Request) -> web.Response:
        run_id, name = request.match_info["run_id"], request.match_info["name"]
        try:   # only a sample (PNG, or a video model's WebP clip) the run announced (sample_saved), by its file name
            launcher = get_launcher()
            path = await asyncio.get_running_loop().run_in_executor(None, sample_file, launcher.dirs, run_id, name,
                                                                    launcher.lora_root)
            # aiohttp's own table has no audio types (an audio model's FLAC would go out as octet-stream)
            kind = AUDIO_TYPES.get(path.suffix.lower())
            return web.FileResponse(path, headers={"Content-Type": kind} if kind else None)
        except RunIdError as e:
            return _error(400, str(e))
        except KeyError:
            return _error(404, f"run {run_id!r} has no sample {name!r}")

    routes.get("/pipetrain/runs/{run_id}")(guarded(get_run))
    routes.post("/pipetrain/runs/{run_id}/stop")(guarded(stop_run))
    routes.post("/pipetrain/runs/{run_id}/resume")(guarded(resume_run))
    for action in run_control.ACTIONS:
        routes.post(f"/pipetrain/runs/{{run_id}}/{action}")(guarded(control_action(action)))


def control_action(action: str):
    def control(launcher, run_id, args):
        return launcher.control(run_id, action, args.get("lr"))
    return control
