# SPDX-License-Identifier: GPL-3.0-or-later
"""Which ComfyUI trains a run: the host's, or PipeTrain's pinned copy when the host's model code moved.

PipeTrain reuses the host ComfyUI's model code, and ``parity/check.py`` proves that our training layers compute what it
computes. When they cannot run against it (an API that moved: an import, an attribute or a keyword argument our
layers use) or the host lacks the model's code, the run may still train correctly on PipeTrain's pinned ComfyUI:
model files and LoRA keys are stable across versions, so what matters is that the host *generates* with the same
maths. So, before a rank imports any ComfyUI (``select_comfyui``, from the CLI):

- the host's parity verdict is read in a child process (two ComfyUIs cannot share one process); it passes: the
  host trains;
- it lacks the model's code: the pinned copy trains;
- otherwise the host's own forward and the pinned copy's own forward run in one child process each, on the same
  weights (seeded by parameter name, float64, the ``micro`` config) and the same probe inputs: equal to rounding,
  the pinned copy trains; different, the run is refused (a LoRA trained on other maths would not match what the
  user generates) — the trainer reports it before anything is cached.

A run on the pinned copy checks each LoRA it saves with the host's own ``LoraLoaderModelOnly`` (a child process
again, the model built on the meta device from the file's header) before the LoRA is announced: every key must be
applied. The decision is memoised beside the parity verdicts, keyed by the files of both ComfyUIs and ours, and
taken under a file lock, so the ranks of one run (and later runs) take it once.

What runs in each child process is ``parity/probe.py``; where the pinned copy lives and how it is installed,
``host/pinned_comfyui.py``.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from . import probe as comfyui_probe
from ..errors import PipeTrainError, RuntimeSetupError
from ..host.pinned_comfyui import pinned_comfyui, pinned_present
from ..host.runtime import PINNED_COMFYUI, PINNED_VERSION

log = logging.getLogger("pipetrain")

# the decision a parent process took, for the ranks and the trainer it starts (JSON of a ComfyChoice)
CHOICE_ENV = "PIPETRAIN_COMFYUI_CHOICE"
_MEMO_VERSION = 1
_PROBE_TIMEOUT = 900


class ComfyUIRefused(PipeTrainError):
    """Neither the host ComfyUI nor the pinned copy can train a LoRA that matches what the host generates."""


class ProbeError(RuntimeSetupError):
    """A probe's child process failed (not a verdict: something is broken)."""


@dataclass
class ComfyChoice:
    model_type: str
    path: str                  # the ComfyUI that trains the run
    version: str
    reason: str                # why that one, in words
    host_path: str
    host_version: str
    pinned: bool = False       # ``path`` is PipeTrain's pinned copy instead of the host's ComfyUI
    host_lacks: bool = False   # the host cannot build this model: its LoRA loader cannot be asked about it
    refused: str = ""          # the run is refused, and why (the trainer raises it before caching)
    host_vs_pinned: float | None = None   # max |host's forward - pinned copy's forward| at the probe
    scale: float | None = None            # max |pinned copy's forward|

    def event(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, text: str) -> "ComfyChoice | None":
        try:
            data = json.loads(text)
            return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})
        except (ValueError, TypeError, KeyError):
            return None


# --- the parent's side of a probe (parity/probe.py is the child's) -----------------------------------------------
def _run_probe(comfyui: Path, *args: str) -> dict:
    """A probe in a child process that imports ``comfyui`` (on the CPU: it is small)."""
    from ..process.command_lines import pipetrain_command

    env = {k: v for k, v in os.environ.items() if k != CHOICE_ENV}
    env.update(COMFYUI_PATH=str(comfyui), CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1", PYTHONSAFEPATH="1")
    try:
        done = subprocess.run(pipetrain_command("comfyui-probe", *args), capture_output=True, text=True, env=env,
                              timeout=_PROBE_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise ProbeError(f"probing ComfyUI at {comfyui} took more than {_PROBE_TIMEOUT} s") from None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
        raise ProbeError(f"probing ComfyUI at {comfyui} failed (exit status {done.returncode}: {tail})")
    return json.loads(lines[-1])


# --- the decision -------------------------------------------------------------------------------------------------
def _compare(host_file: str, pinned_file: str) -> tuple[str, float | None, float | None]:
    """("" or what differs, max |host - pinned|, max |pinned|) of the two forwards the probes saved."""
    import torch

    from .check import TOLERANCE

    host, pinned = torch.load(host_file, weights_only=True), torch.load(pinned_file, weights_only=True)
    if host["weights"] != pinned["weights"]:
        names = sorted(set(host["weights"].items()) ^ set(pinned["weights"].items()))
        return (f"its model's weights are laid out differently ({len(names)} names or shapes differ, e.g. "
                f"{names[0][0]!r})"), None, None
    a, b = host["output"], pinned["output"]
    if a.shape != b.shape:
        return f"its forward's output has shape {tuple(a.shape)}, the pinned copy's {tuple(b.shape)}", None, None
    difference, scale = float((a - b).abs().max()), float(b.abs().max())
    tolerance = TOLERANCE.get(getattr(torch, pinned["dtype"].removeprefix("torch.")), 1e-4)
    if not difference <= tolerance * max(scale, 1e-30):
        return (f"its own forward differs from the pinned ComfyUI {PINNED_VERSION}'s by {difference:.3g} on outputs "
                f"as large as {scale:.3g} (rounding allows {tolerance:g} of it)"), difference, scale
    return "", difference, scale


def _decide(model_type: str, host: Path, host_version: str) -> ComfyChoice:
    base = ComfyChoice(model_type, str(host), host_version, "", str(host), host_version)
    with tempfile.TemporaryDirectory(prefix="pipetrain-probe-") as tmp:
        h = _run_probe(host, "forward", model_type, str(Path(tmp) / "host.pt"), "parity-first")
        if h.get("parity", {}).get("ok"):
            base.reason = f"the host ComfyUI's model code passes the parity check for {model_type!r}"
            return base
        verdict = h.get("parity", {})
        why = h.get("lacks") or h.get("error") or (
            verdict.get("detail", "") + (f" at {verdict['where']}" if verdict.get("where") else ""))
        pinned = pinned_comfyui()
        on_pinned = ComfyChoice(**{**asdict(base), "path": str(pinned), "version": PINNED_VERSION, "pinned": True})
        if h.get("lacks"):
            on_pinned.host_lacks = True
            on_pinned.reason = (f"the host ComfyUI {host_version} lacks the code of {model_type!r} ({why}); "
                                f"PipeTrain's pinned ComfyUI {PINNED_VERSION} trains it")
            return on_pinned
        if "error" in h:
            base.refused = (f"model type {model_type!r}: the host ComfyUI {host_version} ({host}) cannot run "
                            f"PipeTrain's training layers, and {why}, so PipeTrain cannot prove that its pinned "
                            f"ComfyUI {PINNED_VERSION} computes what it generates with. {_what_to_do()}")
            return base
        p = _run_probe(pinned, "forward", model_type, str(Path(tmp) / "pinned.pt"))
        if "forward" not in p:
            raise RuntimeSetupError(f"PipeTrain's pinned ComfyUI {PINNED_VERSION} ({pinned}) cannot run "
                                    f"{model_type!r}: {p.get('lacks') or p.get('error')}; reinstall it with "
                                    f"scripts/setup.sh")
        differs, difference, scale = _compare(h["forward"], p["forward"])
    on_pinned.host_vs_pinned = base.host_vs_pinned = difference
    on_pinned.scale = base.scale = scale
    if differs:
        base.refused = (f"model type {model_type!r}: PipeTrain did not fall back to its pinned ComfyUI "
                        f"{PINNED_VERSION} either, because the host ComfyUI {host_version} ({host}) computes something "
                        f"else: {differs}. A LoRA trained on the pinned copy would not match what the host "
                        f"generates. {_what_to_do()}")
        return base
    on_pinned.reason = (f"PipeTrain's training layers cannot run against the host ComfyUI {host_version}'s model code "
                        f"({why}), while its own forward computes what the pinned ComfyUI {PINNED_VERSION}'s does "
                        f"(largest difference {difference:.1e} of {scale:.1e}): the pinned copy trains")
    return on_pinned


def _what_to_do() -> str:
    from ..host.versions import EVERY_TYPE_PASSES_ON, TESTED_RANGE

    return (f"PipeTrain is tested with ComfyUI {TESTED_RANGE} (every model type passes on {EVERY_TYPE_PASSES_ON}): "
            f"update PipeTrain, or point COMFYUI_PATH at such a ComfyUI and generate with it; "
            f"`python -m pipetrain doctor` shows every model type's verdict on a ComfyUI.")


def _memo_path() -> Path:
    from .check import _memo_file

    return _memo_file().parent / "fallback.json"


def _memo_key(model_type: str, host: Path, pinned: Path) -> str:
    from .check import _comfy_files, _hash_files, _own_files

    # this decision's code and the probes' own: a change to either takes the decision again
    deciders = [Path(__file__).resolve(), Path(comfyui_probe.__file__).resolve()]
    files = _comfy_files(host) + _comfy_files(pinned) + _own_files() + deciders
    return f"v{_MEMO_VERSION}|{model_type}|{host}|{_hash_files(files)}"


@contextmanager
def _locked():
    """One decision at a time on this machine (the ranks of a run start together; the second reads the memo)."""
    import fcntl

    path = _memo_path().with_name("fallback-decision.lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a")
    except OSError:   # a read-only home: no memo, no lock
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _memoised(key: str) -> ComfyChoice | None:
    try:
        hit = json.loads(_memo_path().read_text()).get(key)
    except (OSError, ValueError):
        return None
    return ComfyChoice.from_json(json.dumps(hit)) if hit else None


def _remember(key: str, choice: ComfyChoice) -> None:
    from ..fsutil import atomic_write_json

    try:
        memo = json.loads(_memo_path().read_text())
    except (OSError, ValueError):
        memo = {}
    memo[key] = choice.event()
    try:
        atomic_write_json(_memo_path(), memo)
    except OSError:
        pass


def choose_comfyui(model_type: str, host: Path | None = None) -> ComfyChoice:
    """Which ComfyUI trains ``model_type``: the host's (``runtime.locate_comfyui``, or ``host``) or the pinned copy,
    or neither (``refused`` says why). Imports no ComfyUI into this process."""
    from . import check as parity
    from ..host.runtime import locate_comfyui
    from ..host.versions import read_version

    from ..models.registry import ADAPTERS

    host = Path(host or locate_comfyui()).resolve()
    version = read_version(host)
    same = ComfyChoice(model_type, str(host), version, "", str(host), version)
    if PINNED_COMFYUI.is_dir() and host == PINNED_COMFYUI.resolve():
        same.reason = "the ComfyUI found is PipeTrain's pinned copy"
        return same
    if model_type not in ADAPTERS:   # no training code here at all: the parity check refuses it by name
        same.reason = f"PipeTrain cannot train {model_type!r} on any ComfyUI it has"
        return same
    hit = parity._read_memo().get(parity._memo_key(model_type, version, host))
    if hit and hit.get("verdict") == "passes":   # no child process, no pinned copy needed
        same.reason = f"the host ComfyUI's model code passes the parity check for {model_type!r}"
        return same
    with _locked():
        key = _memo_key(model_type, host, PINNED_COMFYUI.resolve()) if pinned_present() else ""
        choice = _memoised(key) if key else None
        if choice is None:
            try:
                choice = _decide(model_type, host, version)   # installs the pinned copy only where it is needed
            except ProbeError as e:
                same.refused = (f"model type {model_type!r}: which ComfyUI can train it could not be decided: {e}. "
                                f"`python -m pipetrain doctor --comfyui {host}` shows the verdict on that ComfyUI")
                return same
            except RuntimeSetupError as e:   # e.g. offline without the pinned copy: the trainer says so
                same.refused = (f"model type {model_type!r}: the host ComfyUI {version} ({host}) cannot train it "
                                f"and PipeTrain's pinned ComfyUI is unavailable: {e}")
                return same
            if pinned_present():
                _remember(_memo_key(model_type, host, PINNED_COMFYUI.resolve()), choice)
        return choice


def select_comfyui(model_type: str) -> ComfyChoice:
    """Called before this process imports ComfyUI (a rank, a CLI command): the decision of a parent process when
    it passed one (``CHOICE_ENV``), else ``choose_comfyui``; points ``COMFYUI_PATH`` at the ComfyUI that trains and
    passes the decision on to the trainer and any child."""
    from ..host.runtime import _already_imported, locate_comfyui

    choice = ComfyChoice.from_json(os.environ.get(CHOICE_ENV, ""))
    # a decision passed down holds while COMFYUI_PATH still names the ComfyUI it chose
    if choice is None or choice.model_type != model_type or Path(choice.path).resolve() != locate_comfyui():
        choice = choose_comfyui(model_type)
    imported = _already_imported()
    if imported is not None and imported != Path(choice.path).resolve():
        raise RuntimeSetupError(f"this process already imported the ComfyUI at {imported}, but {choice.path} must "
                                f"train {model_type!r} ({choice.reason})")
    os.environ["COMFYUI_PATH"] = choice.path
    os.environ[CHOICE_ENV] = json.dumps(choice.event())
    return choice


def current_choice() -> ComfyChoice | None:
    return ComfyChoice.from_json(os.environ.get(CHOICE_ENV, ""))


# --- what the trainer calls -------------------------------------------------------------------------------------
def check_run(model_type: str, reporter=None) -> None:
    """The trainer's check before caching: which ComfyUI trains and why (event ``comfyui``, the status), a refusal
    raised, then the parity check on the ComfyUI that trains (``parity.check_run``)."""
    from .check import ParityError
    from .check import check_run as check_parity

    choice = current_choice()
    if choice is None or choice.model_type != model_type:   # a trainer started without the CLI's selection
        check_parity(model_type, reporter)
        return
    if reporter is not None:
        reporter.event("comfyui", **choice.event())
    if choice.refused:
        try:
            check_parity(model_type, reporter)
        except ParityError as e:   # the parity verdict first (what and where), then why no fallback
            raise ComfyUIRefused(f"{e} {choice.refused}") from None
        raise ComfyUIRefused(choice.refused)
    check_parity(model_type, reporter)
    if reporter is not None:
        reporter.update(comfyui={**reporter.status.get("comfyui", {}), "pinned": choice.pinned,
                                 "reason": choice.reason, "host": {"path": choice.host_path,
                                                                   "version": choice.host_version}})
    if choice.pinned:
        log.warning("training on PipeTrain's pinned ComfyUI %s: %s", choice.version, choice.reason)


def check_saved_lora(lora_file: Path, model_file: Path, reporter=None) -> dict | None:
    """On a run the pinned copy trains: the saved LoRA loaded by the host's own ``LoraLoaderModelOnly`` (the
    pinned copy's, where the host lacks the model's code) with every key applied, before the LoRA is announced;
    raises ``ComfyUIRefused`` otherwise. None on a run the host trains."""
    choice = current_choice()
    if choice is None or not choice.pinned:
        return None
    loader = Path(choice.path if choice.host_lacks else choice.host_path)
    result = _run_probe(loader, "lora", str(model_file), str(lora_file))
    ok = not result["unmatched"] and result["applied"] == result["modules"] > 0
    if reporter is not None:
        reporter.event("lora_loader_check", lora=str(lora_file), ok=ok, host_lacks=choice.host_lacks, **result)
    if not ok:
        # out of ComfyUI's LoRA list (the folder may be its models/loras), kept for whoever wants to look at it
        kept = Path(f"{lora_file}.unloadable")
        Path(lora_file).replace(kept)
        raise ComfyUIRefused(
            f"{kept}: trained on PipeTrain's pinned ComfyUI {choice.version}, this LoRA does not load fully in "
            f"the ComfyUI {result['version']} at {result['path']}: its LoraLoaderModelOnly applied "
            f"{result['applied']} of the LoRA's {result['modules']} modules"
            + (f" and did not load {len(result['unmatched'])} keys, e.g. {result['unmatched'][0]!r}"
               if result["unmatched"] else "")
            + ". The epoch is not announced (the file is renamed so that no LoRA loader lists it); generate with a "
            f"ComfyUI that loads it, e.g. the pinned copy at {choice.path}.")
    return result
