# SPDX-License-Identifier: GPL-3.0-or-later
"""HTTP routes under ``/pipetrain``: list runs, one run, stop, resume, an epoch's sample images.

Run ids are checked by ``registry.check_run_id`` and the resolved folder must sit directly in the runs
root: a bad id is a 400, an unknown one a 404. State changes are POSTs.
"""
from __future__ import annotations

import asyncio
from typing import Callable

from aiohttp import web

from ..backend.errors import PipeTrainError
from .core import Launcher
from .registry import RunIdError, sample_file


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def add_routes(routes: web.RouteTableDef, get_launcher: Callable[[], Launcher]) -> None:
    def guarded(action):
        async def handler(request: web.Request) -> web.Response:
            run_id = request.match_info.get("run_id", "")
            body = {}
            if request.method == "POST" and request.can_read_body:
                try:
                    body = await request.json()
                except ValueError:
                    body = {}
            args = dict(request.query) | (body if isinstance(body, dict) else {})
            loop = asyncio.get_running_loop()
            try:  # file I/O and process waits stay off the event loop
                return web.json_response(await loop.run_in_executor(None, action, get_launcher(), run_id, args))
            except RunIdError as e:
                return _error(400, str(e))
            except KeyError:
                return _error(404, f"no run {run_id!r}")
            except PipeTrainError as e:
                return _error(409, str(e))
        return handler

    @routes.get("/pipetrain/runs")
    async def list_runs(request: web.Request) -> web.Response:
        return web.json_response({"runs": get_launcher().list()})

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
        try:   # only a PNG the run announced (sample_saved), by its file name
            return web.FileResponse(sample_file(get_launcher().dirs, run_id, name))
        except RunIdError as e:
            return _error(400, str(e))
        except KeyError:
            return _error(404, f"run {run_id!r} has no sample {name!r}")

    routes.get("/pipetrain/runs/{run_id}")(guarded(get_run))
    routes.post("/pipetrain/runs/{run_id}/stop")(guarded(stop_run))
    routes.post("/pipetrain/runs/{run_id}/resume")(guarded(resume_run))
