"""The epoch-samples phase: after each saved epoch LoRA every rank waits while global rank 0 has the samples
rendered (by a process of the run's own, or by the ComfyUI that started it: ``[samples] render``) and announces
them. What renders them and the files between the run and that ComfyUI: ``sampling/``."""
from __future__ import annotations

import logging
import subprocess
import time
from pathlib import Path
from typing import Callable

from ..config import RunConfig
from ..fsutil import OUT_OF_SPACE_EXIT, OutOfSpace
from ..process.child import child_env
from ..process.command_lines import pipetrain_command
from ..run.folder import RunDir
from ..sampling import audio, host_render
from ..sampling.render import sample_strength
from . import distributed

log = logging.getLogger("pipetrain")
SYNC_S = 5.0     # the ranks meet this often while rank 0 waits (DeepSpeed's process-group timeout: 10 min)


def render_epoch_samples(cfg: RunConfig, run_dir: RunDir, reporter, is_main: bool, lora_path: Path | None, epoch: int,
                         step: int, stopping: Callable[[], bool]) -> None:
    """Every rank calls this after an epoch LoRA is saved; returns once its samples are announced (global rank 0,
    ``is_main``, renders them or has them rendered; ``stopping``: whether a stop has been asked for)."""
    if cfg.samples is None:
        return
    job = EpochSamples(cfg, run_dir, reporter, lora_path, epoch, step, stopping=stopping)
    full = wait_together(job.poll if is_main and lora_path is not None else None)
    if isinstance(full, str) and full.startswith(_FULL):   # a full disk fails the run, as it does in training
        raise OutOfSpace(Path(full[len(_FULL):]))


_FULL = "full:"   # what rank 0's poll answers when the sample renderer found the disk full, then the folder


def wait_together(poll: Callable[[], object] | None, interval: float = 0.2, sync_s: float = SYNC_S):
    """Called by every rank; global rank 0 passes ``poll``, called until it returns something other than None,
    which every rank gets back. The ranks meet every ``sync_s`` seconds, so no collective waits for long."""
    while True:
        result = None
        if poll is not None:
            end = time.monotonic() + sync_s
            while (result := poll()) is None and time.monotonic() < end:
                time.sleep(interval)
        result = distributed.broadcast_object(result)
        if result is not None:
            return result


class EpochSamples:
    """Global rank 0's side of one epoch's samples: a state machine that ``poll`` advances without blocking.

    host: request written -> marker with PNGs (announce) | marker with an error, or no answer within
    ``host_timeout_s`` (warn, render here) | a stop asked for (warn; the request stays for ComfyUI).
    run: ``python -m pipetrain sample`` in a child process -> announce, or warn with its error."""

    def __init__(self, cfg: RunConfig, run_dir: Path | RunDir, reporter, lora: Path, epoch: int, step: int,
                 stopping: Callable[[], bool] = lambda: False):
        self.cfg, self.run_dir, self.reporter = cfg, RunDir(run_dir), reporter
        self.lora, self.epoch, self.step, self.stopping = lora, epoch, step, stopping
        self.proc: subprocess.Popen | None = None
        self.deadline = None

    def poll(self) -> str | None:
        """None while waiting; then what happened: "host", "run", "failed", "stopped" or "full:<folder>"."""
        if self.proc is None and self.deadline is None:
            if self.cfg.samples.render == "host":
                self.announce_left_over()
                request = host_render.write_request(self.run_dir, self.lora, self.epoch, self.step)
                self.reporter.event("sample_request", epoch=self.epoch, step=self.step, lora=str(self.lora),
                                    request=request["request"], marker=request["marker"],
                                    prompts=len(self.cfg.samples.prompts))
                self.deadline = time.monotonic() + self.cfg.samples.host_timeout_s
            else:
                self.render_here()
            return None
        return self._poll_run() if self.proc is not None else self._poll_host()

    def _poll_host(self) -> str | None:
        marker = host_render.read_marker(self.lora)
        if marker is not None and not marker.get("error"):
            self.announce(marker)
            host_render.withdraw(self.run_dir, self.lora)
            return "host"
        if marker is not None:
            self.render_here(f"ComfyUI could not render the samples for epoch {self.epoch} ({marker['error']})")
        elif self.stopping():
            self.warn(f"stopping: the samples for epoch {self.epoch} are left to ComfyUI "
                      f"({host_render.request_path(self.run_dir, self.lora)}); a resumed run announces them")
            return "stopped"
        elif time.monotonic() > self.deadline:
            self.render_here(f"ComfyUI did not render the samples for epoch {self.epoch} within "
                             f"{self.cfg.samples.host_timeout_s:g} s (closed or busy?)")
        return None

    def render_here(self, why: str | None = None) -> None:
        """Start ``python -m pipetrain sample`` (the run renders its samples itself)."""
        if why is not None:
            host_render.withdraw(self.run_dir, self.lora)
            host_render.marker_path(self.lora).unlink(missing_ok=True)
            self.warn(f"{why}; the training run renders them itself")
        cmd = pipetrain_command("sample", str(self.run_dir.run_toml), str(self.lora))
        with open(self.run_dir.samples_log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env())   # dies with us

    def _poll_run(self) -> str | None:
        if self.proc.poll() is None:
            return None
        if self.proc.returncode == OUT_OF_SPACE_EXIT:
            return f"{_FULL}{self.lora.parent}"
        marker = host_render.read_marker(self.lora)
        if self.proc.returncode != 0 or marker is None or marker.get("error"):
            tail = self.run_dir.samples_log.read_text(errors="replace").strip().splitlines()[-1:]
            self.warn(f"sampling failed for epoch {self.epoch}: {tail} (see {self.run_dir.samples_log})")
            return "failed"
        self.announce(marker)
        return "run"

    def announce(self, marker: dict, epoch: int | None = None, step: int | None = None) -> None:
        epoch, step = epoch or self.epoch, step or self.step
        prompts = self.cfg.samples.prompts
        for k, png in enumerate(marker["pngs"]):
            i, strength = k % len(prompts), sample_strength(png)
            self.reporter.event("sample_saved", epoch=epoch, step=step, path=png, prompt=prompts[i], prompt_index=i,
                                strength=strength, renderer=marker.get("renderer"))
            tag = f"samples/{i:02d}" + (f"-x{strength:.2f}" if strength != 1.0 else "")
            (self.reporter.audio if audio.is_audio_file(png) else self.reporter.image)(tag, png, step)

    def announce_left_over(self) -> None:
        """Samples ComfyUI rendered for an earlier epoch after the run stopped waiting (a stop, then resume)."""
        for path in host_render.requests(self.run_dir):
            request = host_render.read_json(path) or {}
            marker = host_render.read_marker(Path(request.get("lora", path)))
            if marker is not None and not marker.get("error"):
                self.announce(marker, epoch=request.get("epoch"), step=request.get("step"))
                path.unlink(missing_ok=True)

    def warn(self, message: str) -> None:
        self.reporter.event("warning", message=message, epoch=self.epoch)
        log.warning("%s", message)
