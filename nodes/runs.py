# SPDX-License-Identifier: GPL-3.0-or-later
"""Run Status, Stop, Run Control and Load Epoch LoRA: nodes over existing runs (by id, or the Train node's RUN)."""
from __future__ import annotations

import threading
import time

from comfy_api.latest import io, ui

from ..backend.errors import PipeTrainError
from ..launcher.core import CONTROL_ACTIONS, CONTROL_LR, CONTROL_MAX_LR
from . import types as t
from .declared import CheckedNode

NEWEST = "newest"
_lora_cache: dict[tuple, dict] = {}


def _launcher():
    from ..launcher.comfy import get_launcher
    return get_launcher()


class _RunIds:
    """The run ids the Run combos offer. ComfyUI builds a node's schema on its event loop each time it validates one
    (and for /object_info), and listing the runs folder takes a stat per folder in it: SaveImage can make any
    number of folders there (100,000 took seconds a listing), and a prompt may hold many Run Status nodes. So a
    listing is made on a thread and waited for ``ON_LOOP_S`` at most (a few milliseconds as a rule, so a run shows
    at once); one that takes longer leaves the combos the last listing meanwhile, and is not waited for again while
    it goes on. Only the first listing is waited for to its end."""
    ON_LOOP_S = 0.05

    def __init__(self):
        self.ids: list[str] | None = None
        self.lock = threading.Lock()
        self.worker: threading.Thread | None = None

    def get(self) -> list[str]:
        with self.lock:
            worker, started = self.worker, False
            if worker is None or not worker.is_alive():
                worker = self.worker = threading.Thread(target=self._list, name="pipetrain-run-ids", daemon=True)
                worker.start()
                started = True
        if self.ids is None:
            worker.join()
        elif started:   # a listing already under way (a slow one): the last listing at once
            worker.join(self.ON_LOOP_S)
        return list(self.ids or [])

    def _list(self) -> None:
        self.ids = _launcher().dirs.ids()


_run_ids = _RunIds()


def run_options() -> list[str]:
    return [NEWEST] + _run_ids.get()


def run_inputs() -> list:
    return [
        io.Combo.Input("run", options=run_options(), default=NEWEST, tooltip="Run id (folder under "
                       "output/pipetrain); 'newest' is the most recently started run"),
        t.Run.Input("run_handle", optional=True, tooltip="A run from the Train node; overrides 'run'"),
    ]


def resolve_run(run: str, run_handle=None) -> str:
    if run_handle is not None:
        return run_handle.run_id
    ids = _launcher().dirs.ids()
    if run == NEWEST:
        if not ids:
            raise ValueError("there is no PipeTrain run yet; start one with the Train node")
        return ids[0]
    if run not in ids:
        raise ValueError(f"no PipeTrain run {run!r} under output/pipetrain")
    return run


def _validate_run(run) -> bool | str:
    if run is None or run == NEWEST:
        return True
    return True if _launcher().dirs.exists(run) else f"no PipeTrain run {run!r} under output/pipetrain"


def status_text(s: dict) -> str:
    parts = [f"{s['id']}: {s['state']}"]
    if s.get("total_steps"):
        parts.append(f"step {s.get('step') or 0}/{s['total_steps']}")
    if s.get("epoch") is not None:
        parts.append(f"epoch {s['epoch']}/{s.get('epochs') or '?'}")
    if s.get("loss") is not None:
        parts.append(f"loss {s['loss']:.4f}")
    if s.get("eta_s"):
        parts.append(f"ETA {int(s['eta_s']) // 60} min")
    if s.get("error"):
        parts.append(f"error: {s['error']}")
    memory = s.get("memory") or {}
    if memory.get("chosen"):   # memory = "auto" (backend/train/memory_auto.py)
        planned = "/".join(f"{g:.1f}" for g in memory.get("stages_gib", []))
        parts.append(f"memory auto: {memory['chosen']} (planned {planned} of {memory.get('gpu_gib')} GiB)")
    comfyui = s.get("comfyui") or {}
    if comfyui.get("parity") and not s.get("error"):
        parts.append(f"ComfyUI {comfyui.get('version')}: parity {comfyui['parity'].get('verdict')}")
    if comfyui.get("pinned"):   # backend/parity/fallback.py: the host's model code moved or is missing
        parts.append(f"trained on PipeTrain's pinned ComfyUI {comfyui.get('version')} instead of "
                     f"ComfyUI {(comfyui.get('host') or {}).get('version')}: {comfyui.get('reason')}")
    return ", ".join(parts)


class _LiveRunNode(CheckedNode):
    """A node that reads or acts on a run as it is now: checked by run id, run again each time it is queued."""

    @classmethod
    def validate_inputs(cls, run=None):
        return _validate_run(run)

    @classmethod
    def fingerprint_inputs(cls, **kw):
        return float("nan")


class RunStatusNode(_LiveRunNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="PipeTrainRunStatus", display_name="PipeTrain Run Status", category=t.CATEGORY,
            is_output_node=True, description="The state, progress and newest epoch LoRA of a run.",
            inputs=run_inputs(),
            outputs=[io.String.Output(display_name="status"), io.Int.Output(display_name="step"),
                     io.Int.Output(display_name="newest_epoch"), io.String.Output(display_name="newest_lora")],
        )

    @classmethod
    def execute(cls, run, run_handle=None) -> io.NodeOutput:
        s = _launcher().get(resolve_run(run, run_handle))
        newest = max(s["loras"], key=lambda x: x.get("epoch", 0), default={})
        text = status_text(s)
        return io.NodeOutput(text, int(s.get("step") or 0), int(newest.get("epoch", 0)), newest.get("path", ""),
                             ui=ui.PreviewText(text))


class StopNode(_LiveRunNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="PipeTrainStop", display_name="PipeTrain Stop", category=t.CATEGORY, is_output_node=True,
            description="Stop a run: it saves a checkpoint at the next step and exits (resume it from the panel).",
            inputs=run_inputs() + [io.Boolean.Input("kill", default=False, tooltip="Kill at once without a "
                                                    "checkpoint (for a run that does not respond)")],
            outputs=[io.String.Output(display_name="status")],
        )

    @classmethod
    def execute(cls, run, kill, run_handle=None) -> io.NodeOutput:
        run_id = resolve_run(run, run_handle)
        try:
            s = _launcher().stop(run_id, kill=kill)
            text = status_text(s)
        except PipeTrainError as e:
            text = str(e)
        return io.NodeOutput(text, ui=ui.PreviewText(text))


class RunControlNode(_LiveRunNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="PipeTrainRunControl", display_name="PipeTrain Run Control", category=t.CATEGORY,
            is_output_node=True, description="Act on a run while it trains, at its next step: save a LoRA and a "
            "checkpoint now, render the sample prompts now, stop after this epoch, or train on with a new learning "
            "rate.",
            inputs=run_inputs() + [
                io.Combo.Input("action", options=list(CONTROL_ACTIONS), default=CONTROL_ACTIONS[0],
                               tooltip="save: step LoRA + checkpoint; sample: step LoRA + samples; stop_after_epoch: "
                               "finish the epoch, checkpoint, stop; lr: the learning rate below from the next step"),
                io.Float.Input("lr", default=1e-4, min=1e-8, max=CONTROL_MAX_LR, step=1e-5, round=1e-8,
                               tooltip="The new base learning rate (action 'lr' only); the schedule's warm-up and "
                               "decay go on applying to it, and a resume keeps it"),
            ],
            outputs=[io.String.Output(display_name="status")],
        )

    @classmethod
    def execute(cls, run, action, lr, run_handle=None) -> io.NodeOutput:
        run_id = resolve_run(run, run_handle)
        try:
            _launcher().control(run_id, action, lr if action == CONTROL_LR else None)
            asked = f"{action} {lr:g}" if action == CONTROL_LR else action
            text = f"{run_id}: {asked} asked for; the run acts at its next step (a 'control' event says when)"
        except (PipeTrainError, ValueError) as e:   # ValueError: run_control's ControlValueError
            text = str(e)
        return io.NodeOutput(text, ui=ui.PreviewText(text))


def _lora_file(run_id: str, epoch: int) -> dict:
    from ..launcher.summaries import lora_for_epoch
    launcher = _launcher()
    found = lora_for_epoch(launcher.dirs, run_id, epoch, launcher.lora_root)
    if found is None:
        which = f"epoch {epoch}" if epoch else "any epoch"
        have = sorted(x.get("epoch") for x in launcher.get(run_id)["loras"])
        raise ValueError(f"run {run_id} has no saved LoRA for {which} yet (saved epochs: {have or 'none'})")
    return found


class LoadEpochLoRANode(CheckedNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="PipeTrainLoadEpochLoRA", display_name="PipeTrain Load Epoch LoRA", category=t.CATEGORY,
            description="Apply the LoRA a run saved after an epoch (the newest by default) to a model.",
            inputs=[io.Model.Input("model", tooltip="The base model to apply the LoRA to")] + run_inputs() + [
                io.Int.Input("epoch", default=0, min=0, max=100000, tooltip="Epoch whose LoRA to load; 0 = the newest "
                             "(re-checked each time the workflow is queued)"),
                io.Float.Input("strength", default=1.0, min=-10.0, max=10.0, step=0.01, tooltip="LoRA strength"),
            ],
            outputs=[io.Model.Output(display_name="model")],
        )

    @classmethod
    def validate_inputs(cls, run=None):
        return _validate_run(run)

    @classmethod
    def fingerprint_inputs(cls, **kw):
        try:
            found = _lora_file(resolve_run(kw.get("run", NEWEST), kw.get("run_handle")), kw.get("epoch", 0))
        except (ValueError, KeyError, PipeTrainError):
            return float("nan")
        return (found["path"], found.get("step"), kw.get("strength"))

    @classmethod
    def execute(cls, model, run, epoch, strength, run_handle=None) -> io.NodeOutput:
        import os

        import comfy.lora
        import comfy.sd
        import comfy.utils
        run_id = resolve_run(run, run_handle)
        found = _lora_file(run_id, epoch)
        key = (found["path"], os.path.getmtime(found["path"]))
        if key not in _lora_cache:
            _lora_cache.clear()
            _lora_cache[key] = comfy.utils.load_torch_file(found["path"], safe_load=True)
        lora = _lora_cache[key]
        where = f"run {run_id}, epoch {found.get('epoch')}: {os.path.basename(found['path'])}"
        # ComfyUI applies the keys its map of this model names and only logs the others to its console
        skipped = unapplied(lora, comfy.lora.model_lora_keys_unet(model.model, {}))
        if len(skipped) == len(lora):
            raise ValueError(f"the LoRA of {where} applies to none of this model's weights: it was trained on "
                             "another base model. Load the model files that run trained on, or choose a run "
                             "trained on this model")
        # at strength 0 the model itself, as LoraLoaderModelOnly returns it: patches of strength 0 would have ComfyUI
        # recompute every adapted weight (the 2nd render of the test template's strength comparison) to no effect
        patched = model if strength == 0 else comfy.sd.load_lora_for_models(model, None, lora, strength, 0)[0]
        text = f"loaded {where} at strength {strength:g}"
        if skipped:
            text += (f"\nwarning: {len(skipped)} of {len(lora)} tensors of this LoRA do not apply to this model "
                     "and are left out; was it trained on these model files?")
        return io.NodeOutput(patched, ui=ui.PreviewText(text))


def unapplied(lora: dict, key_map: dict) -> list[str]:
    """The LoRA file's tensors that no weight of the model takes: those whose name has no prefix in ComfyUI's key
    map of the model (``model_lora_keys_unet``), the names ``comfy.lora.load_lora`` logs as not loaded."""
    def applies(name: str) -> bool:
        parts = name.split(".")
        return any(".".join(parts[:i]) in key_map for i in range(len(parts) - 1, 0, -1))
    return [name for name in lora if not applies(name)]
