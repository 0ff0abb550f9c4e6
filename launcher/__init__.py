# SPDX-License-Identifier: GPL-3.0-or-later
"""Runs inside ComfyUI: owns jobs (run directories), spawns them detached, re-attaches, stops them,
relays their events to the browser and serves the ``/pipetrain`` routes. See ``core.Launcher``."""
