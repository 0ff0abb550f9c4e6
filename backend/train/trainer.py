"""The trainer: named phases over one run (set up ranks, run directory, cache, engine, resume, loop)."""
from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..run import control as run_control
from ..config import RunConfig, save_toml, without_secrets
from ..process.deepspeed_cli import note_run_dir
from ..errors import CheckpointError, PipeTrainError
from ..fsutil import exit_between_writes
from ..parity.fallback import check_saved_lora
from ..models.base import DTYPES
from ..models.loading import check_architecture
from ..models.registry import adapter_class
from ..run.folder import RunDir, cache_folder, check_unused, choose_run_dir
from ..host.runtime import comfy_training_paths
from ..host.versions import comfyui_info, range_warning
from . import checkpoint, dataset_record, distributed, dp_layout
from .events import RunReporter, with_entry
from .failure import explain_failure, lost_peer
from .launcher_watch import POLL_S, LauncherWatch
from .parts import CachedData, EngineParts, RunState, Topology
from .peer_watch import PeerWatch
from .saving import gather_lora, save_full_model, sweep_run_dir, weights_stem, write_lora
from .schedule import force_rates, set_base_lr
from .stop_signals import StopSignals, describe

if TYPE_CHECKING:
    from ..models.base import ModelAdapter

log = logging.getLogger("pipetrain")


@dataclass
class TrainOptions:
    resume: str | None = None          # "" = newest run with a checkpoint; a name or path otherwise
    regenerate_cache: bool = False
    trust_cache: bool = False
    cache_only: bool = False
    progress: bool = True
    # diffusion-pipe's resume flags: keep the epoch but start its data again; load no optimizer / schedule state;
    # load the optimizer's state but its settings from the config, the schedule from its start
    reset_dataloader: bool = False
    reset_optimizer: bool = False
    reset_optimizer_params: bool = False


# how long a rank whose launcher has gone waits for the checkpoint of a stop asked for at the same time
STOP_GRACE_S = 120.0


class PeerFailed(PipeTrainError):
    """Another rank failed and told why (``distributed.tell_failure``)."""


class Trainer:
    """One run on this rank. Each phase below returns a part that the trainer keeps (``parts.py``); a part is
    None until its phase has run."""
    topology: Topology | None          # setup_distributed
    run_dir: RunDir | None             # prepare_run_dir
    reporter: RunReporter | None       # prepare_run_dir
    adapter: ModelAdapter | None       # load_adapter
    data: CachedData | None            # prepare_cache
    parts: EngineParts | None          # build_engine
    state: RunState                    # restore (from a checkpoint), then advanced by the loop
    signals: StopSignals | None        # SIGINT, SIGTERM: checkpoint and stop as the stop file does

    def __init__(self, cfg: RunConfig, options: TrainOptions):
        self.cfg = cfg
        self.opts = options
        self.topology = self.run_dir = self.reporter = self.adapter = self.data = self.parts = None
        self.state = RunState()
        self.signals = None
        self.launcher_watch: LauncherWatch | None = None
        self.peer_watch: PeerWatch | None = None
        self.run_dir_lock = None   # held until this process ends
        self._dataset_record: dict | None = None   # what checkpoints keep of the dataset (dataset_record.py)

    # --- phases -----------------------------------------------------------------------------
    def run(self) -> int:
        with comfy_training_paths():   # ComfyUI's autograd-safe code paths where it has them (host/runtime.py)
            code = self._run()
        distributed.finish()
        return code

    def _run(self) -> int:
        self.topology = self.setup_distributed()
        self.watch_launcher()
        self.run_dir, self.reporter = self.prepare_run_dir()
        self.peer_watch = PeerWatch(self.topology.rank, self.topology.world, self._peer_silent, self._peer_answers)
        self.peer_watch.start()
        try:
            self.adapter = self.load_adapter()
            self.check_model_code()
            self.data = self.prepare_cache()
            if self.opts.cache_only:
                self.reporter.update(state="cached")
                self.reporter.event("done", reason="cache_only")
                return 0
            if self.stop_before_training():
                return 0
            if self.cfg.memory == "auto":
                from .memory_auto import plan_memory
                self.cfg = plan_memory(self.cfg, self.data, self.topology, self.reporter)
            self.parts = self.build_engine()
            self.state = self.restore()
            self.train_loop()
            return 0
        except BaseException as e:
            if lost_peer(e) and (pid := self.launcher_watch.gone()) is not None:
                self._on_launcher_gone(pid)   # the peer went with the launcher: say so, not "lost contact"
            if self.topology.is_main and not isinstance(e, SystemExit):
                peer = distributed.peer_failure() if lost_peer(e) else None
                message = explain_failure(e, self.run_dir.name, peer, self.own_paths())
                self.reporter.fail(message)
                log.error(message)
                if peer is not None:   # the other rank's reason, not this rank's traceback of the lost contact
                    raise PeerFailed(message) from None
            if not self.topology.is_main and lost_peer(e):
                # another rank failed and says why; a traceback here buries it
                log.error("rank %d stops: another rank has failed", self.topology.rank)
                raise SystemExit(1) from None
            if not self.topology.is_main and not isinstance(e, SystemExit):
                distributed.tell_failure(explain_failure(e, self.run_dir.name, own=self.own_paths()))
            raise
        finally:
            self.peer_watch.stop()
            self.reporter.close()

    def own_paths(self) -> tuple[Path, ...]:
        """What a failure message may name: the run's folders and the files and folders its config names."""
        try:
            return self._own_paths()
        except Exception:   # noqa: BLE001  (the failure being reported matters more; nothing else is named then)
            return (self.run_dir.path,) if self.run_dir is not None else ()

    def _own_paths(self) -> tuple[Path, ...]:
        cfg = self.cfg
        paths = [self.run_dir.path, cfg.resolve(cfg.output_dir), *(cfg.resolve(p) for _, p in cfg.model.file_paths())]
        if cfg.lora_dir:
            paths.append(cfg.resolve(cfg.lora_dir))
        for ds in (cfg._dataset, *(cfg._evals or {}).values()):
            if ds is not None:
                for d in ds.directory:
                    paths += [ds.directory_path(d), *ds.control_paths(d)]
                    paths += [p for p in (ds.mask_path(d), ds.default_mask_file(d), ds.control_mask_path(d),
                                          ds.reference_path(d)) if p is not None]
        return tuple(p.resolve() for p in paths)

    def setup_distributed(self) -> Topology:
        rank, world, local_rank = distributed.init()
        if not self.opts.cache_only:  # caching spreads over any number of ranks
            self.cfg.check_world_size(world)
        return Topology(rank, world, local_rank, self.cfg.pipeline_stages)

    def watch_launcher(self) -> None:
        """SIGINT and SIGTERM ask for a stop (``stop_signals.py``); the end of the DeepSpeed launcher ends this rank
        (``launcher_watch.py``)."""
        self.signals = StopSignals(self._stop_at_once, self._stop_caching if self.opts.cache_only else None)
        self.signals.install()
        self.launcher_watch = LauncherWatch()
        self.launcher_watch.start(self._launcher_gone_from_watch)

    def prepare_run_dir(self) -> tuple[RunDir, RunReporter]:
        is_main = self.topology.is_main
        run_dir, refused = None, None
        if is_main:
            try:
                if self.opts.cache_only:  # caching alone makes no run; its events go beside the cache
                    run_dir = RunDir(cache_folder(self.cfg.resolve(self.cfg.output_dir)))
                    run_dir.path.mkdir(parents=True, exist_ok=True)
                else:
                    run_dir = choose_run_dir(self.cfg, self.opts.resume)
                    self.run_dir_lock = run_dir.lock()   # first: a run still going is named as such
                    if self.opts.resume is None:
                        check_unused(run_dir, self.cfg)
            except PipeTrainError as e:
                refused = e
        run_dir, message = distributed.broadcast_object((str(run_dir) if run_dir else None,
                                                         str(refused) if refused else None))
        if refused is not None:
            raise refused
        if message is not None:   # rank 0 reports it; the other ranks just stop
            raise SystemExit(2)
        run_dir = RunDir(Path(run_dir))
        reporter = RunReporter(run_dir, enabled=is_main, tensorboard=run_dir.path
                               if self.cfg.run_layout == dp_layout.LAYOUT else None)
        if is_main:
            if not self.opts.cache_only:
                sweep_run_dir(run_dir, self.lora_folder(run_dir))
            run_dir.checkpoints.mkdir(parents=True, exist_ok=True)
            if not self.opts.cache_only and not run_dir.run_toml.exists():
                save_toml(self.cfg.with_absolute_paths(), run_dir.run_toml)
                save_toml(self.cfg.dataset_config.with_absolute_paths(), run_dir.dataset_toml)
            note_run_dir(run_dir.path)
            comfyui = comfyui_info()
            reporter.update(state="starting", run_dir=str(run_dir), world_size=self.topology.world,
                            pipeline_stages=self.cfg.pipeline_stages, comfyui=comfyui)
            reporter.event("start", world_size=self.topology.world, pipeline_stages=self.cfg.pipeline_stages,
                           resume=self.opts.resume is not None, comfyui=comfyui)
            warning = range_warning(comfyui["version"])
            if warning:
                reporter.event("warning", message=warning)
                log.warning(warning)
            if not self.opts.cache_only:
                from .wandb_sink import attach
                attach(reporter, self.cfg, run_dir.name, run_dir.path)
        distributed.barrier()
        return run_dir, reporter

    def load_adapter(self) -> ModelAdapter:
        adapter = adapter_class(self.cfg.model.type)(self.cfg.model, self.cfg.resolve)
        check_architecture(adapter.model_files()["diffusion_model"][0], self.cfg.model.type)
        return adapter

    def check_model_code(self) -> None:
        """Refuse, before anything is cached, a ComfyUI whose model code computes something other than the
        training layers (``parity/check.py``; memoised, so a repeated run pays nothing), or says why the pinned ComfyUI
        trains instead (``parity/fallback.py``)."""
        from ..parity.fallback import check_run

        error = None
        if self.topology.is_main:
            try:
                check_run(self.cfg.model.type, self.reporter)
            except Exception as e:  # noqa: BLE001  (re-raised on every rank below)
                error = e
        if distributed.broadcast_object(error is not None):
            if self.topology.is_main:
                raise error
            raise SystemExit(1)

    def prepare_cache(self) -> CachedData:
        from .caching import prepare_cache

        if not self.opts.cache_only:   # fail before the (possibly long) cache phase on an optimizer not to be built
            from ..optim.registry import resolve_optimizer
            resolve_optimizer(self.cfg)
        self.reporter.update(state="caching")
        return prepare_cache(self.cfg, self.adapter, self.topology, self.reporter,
                             regenerate=self.opts.regenerate_cache, trust=self.opts.trust_cache)

    def build_engine(self) -> EngineParts:
        from .engine import build_engine

        self.reporter.update(state="loading")
        return build_engine(self.cfg, self.adapter, self.topology, self.data, self.reporter)

    def stopping(self) -> bool:
        """Whether a stop has been asked for (a signal or the stop file); rank 0 reads the file for every rank."""
        return (self.signals is not None and self.signals.requested) or self.run_dir.stop_requested()

    def stop_before_training(self) -> bool:
        """A stop asked for while caching ends the run before the engine is built (nothing to checkpoint)."""
        stop = None
        if self.topology.is_main:
            stop = self.stopping()
        if not distributed.broadcast_object(stop):
            return False
        if self.topology.is_main:
            self.run_dir.clear_stop()
            signum = self.signals.signum if self.signals is not None else None
            reason = "stopped before training began" + (f": {describe(signum)} received" if signum else "")
            self.reporter.event("stopped", step=self.state.global_step, epoch=self.state.epoch, before_training=True)
            self.reporter.update(state="stopped", stop_signal=signum, stop_reason=reason)
        return True

    def restore(self) -> RunState:
        """The run's position: from the start, or from the newest checkpoint on a resume (which also loads the
        engine's weights, optimizer and schedule from it)."""
        parts, is_main = self.parts, self.topology.is_main
        state = RunState(total_steps=parts.total_steps)
        if self.opts.resume is None:
            return state
        tag, skipped = checkpoint.resume_tag(self.run_dir.checkpoints)
        if is_main:
            for bad, problem in skipped:
                message = f"checkpoint {bad} is not resumed from: {problem}"
                log.warning("%s", message)
                self.reporter.event("warning", message=message, checkpoint=bad)
        if tag is None and skipped:   # starting over would replace them: the user decides
            raise CheckpointError(f"no checkpoint in {self.run_dir.checkpoints} is intact ({skipped[0][1]}): "
                                  "move that folder away to train this run from the beginning")
        if tag is None:
            if is_main:
                log.warning("no checkpoint in %s: starting from the beginning", self.run_dir)
            self.replay_controls(state)
            return state
        opts = self.opts
        saved = checkpoint.load(parts.engine, self.run_dir.checkpoints, tag, optimizer=not opts.reset_optimizer,
                                settings=not (opts.reset_optimizer or opts.reset_optimizer_params))
        if parts.ema is not None and not parts.ema.load(self.run_dir.checkpoints / tag) and is_main:
            log.warning("checkpoint %s holds no moving average (saved without ema): it starts from the resumed "
                        "weights", tag)
        state.global_step = state.last_checkpoint_step = saved["global_step"]
        # None from a checkpoint written before this was kept: the run's end then saves its LoRA again
        state.last_saved_step = saved.get("last_saved_step")
        state.epoch = saved["epoch"]
        state.step_in_epoch = saved["step_in_epoch"]
        if opts.reset_dataloader:   # diffusion-pipe's --reset_dataloader: the epoch from its first step
            state.step_in_epoch = 0
        if self.cfg.force_constant_lr is not None:   # diffusion-pipe's: the config's rate, whatever was saved
            force_rates(parts.engine.lr_scheduler, self.cfg.force_constant_lr)
        elif saved.get("base_lr") is not None and not (opts.reset_optimizer or opts.reset_optimizer_params):
            # set while it trained: the run goes on with it, not the config's
            state.base_lr = saved["base_lr"]
            set_base_lr(parts.engine.lr_scheduler, state.base_lr)
        global_batch, steps_per_epoch = parts.global_batch, parts.plan.steps_per_epoch()
        saved_batch = saved.get("global_batch", global_batch)
        if saved_batch != global_batch:  # another number of data-parallel ranks (e.g. more nodes)
            examples = state.step_in_epoch * saved_batch
            state.step_in_epoch = min(examples // global_batch, steps_per_epoch)
            if is_main and examples % global_batch:
                log.warning("resuming with a global batch of %d instead of %d: the epoch continues after %d of "
                            "its %d examples", global_batch, saved_batch, state.step_in_epoch * global_batch,
                            examples)
        remaining = (self.cfg.epochs - state.epoch + 1) * steps_per_epoch - state.step_in_epoch
        state.total_steps = state.global_step + remaining
        if self.cfg.max_steps:
            state.total_steps = min(state.total_steps, self.cfg.max_steps)
        if is_main:
            self.say_dataset_changes(saved, tag, steps_per_epoch, state.total_steps)
        self.replay_controls(state)   # before the resume event, which says the learning rate
        if is_main:
            self.reporter.event("resume", checkpoint=tag, step=state.global_step, epoch=state.epoch,
                                global_batch=global_batch, saved_global_batch=saved_batch, base_lr=state.base_lr)
        return state

    def say_dataset_changes(self, saved: dict, tag: str, steps_per_epoch: int, total_steps: int) -> None:
        """Rank 0: a dataset changed since the checkpoint (pictures deleted, added or swapped) trains on what is there
        now, which the status, an event and the log say (how many items, where, and the steps that makes)."""
        said = dataset_record.changes(saved.get("dataset"), self.dataset_record())
        if not said:
            return
        before = saved.get("total_steps")
        steps = f"{total_steps} steps in all" + (f" instead of {before}" if isinstance(before, int) and
                                                 before != total_steps else "")
        message = (f"the dataset differs from the one checkpoint {tag} trained on: {'; '.join(said)}. The run goes "
                   f"on with the items there now ({steps_per_epoch} steps an epoch, {steps}); put them back and "
                   "resume again to train on the dataset it started with")
        log.warning("%s", message)
        self.reporter.warn("dataset", message, dataset_changes=said, step=saved["global_step"])

    def dataset_record(self) -> dict:
        if self._dataset_record is None:
            self._dataset_record = dataset_record.record(self.data.entries)
        return self._dataset_record

    def replay_controls(self, state: RunState) -> None:
        """A learning rate change the run acknowledged after the checkpoint it resumes from (killed before the next
        one) goes on applying: the resumed steps train with it, as the status said."""
        applied, error = None, None
        if self.topology.is_main:
            try:
                applied = run_control.applied_lr(self.run_dir)
            except run_control.ControlValueError as e:
                error = str(e)
        applied, error = distributed.broadcast_object((applied, error))
        if error is not None:
            raise CheckpointError(error)
        if applied is None or applied[1] <= state.global_step:   # the checkpoint holds it (or a later one)
            return
        lr, from_step = applied
        state.base_lr = lr
        set_base_lr(self.parts.engine.lr_scheduler, lr)
        if self.topology.is_main:
            self.reporter.event("control", action=run_control.LR, lr=lr, step=state.global_step,
                                from_step=state.global_step + 1, replayed_from_step=from_step)
            self.reporter.update(base_lr=lr)
            log.info("learning rate %g (set at step %d) from step %d on", lr, from_step, state.global_step + 1)

    def train_loop(self) -> None:
        from .loop import run_loop

        run_loop(self)

    # --- helpers used by the phases ---------------------------------------------------------
    def save_checkpoint(self) -> None:
        state = self.state
        if state.global_step == state.last_checkpoint_step:   # e.g. the last epoch's, again as the run ends
            return
        state.last_checkpoint_step = state.global_step
        client_state = state.client_state(self.parts.global_batch) | {"dataset": self.dataset_record(),
                                                                       "total_steps": state.total_steps}
        path = checkpoint.save(self.parts.engine, self.run_dir.checkpoints, state.global_step, client_state,
                               extra=self._save_ema)
        state.last_checkpoint_time = time.monotonic()
        if self.topology.is_main:
            self.reporter.event("checkpoint", step=state.global_step, epoch=state.epoch, path=str(path))
            self.reporter.update(last_checkpoint=str(path))
            if self.cfg.run_layout == dp_layout.LAYOUT:
                dp_layout.link_checkpoint(self.run_dir.path, state.global_step, Path(path))

    def _save_ema(self, folder: Path) -> None:
        """Into a checkpoint being written: this stage's moving average (``ema``), from its data-parallel rank 0."""
        if self.parts.ema is not None and self.topology.dp_rank == 0:
            self.parts.ema.save(folder, self.parts.engine.stage_id)

    def save_lora(self, epoch: int, *, at_step: bool = False) -> Path | None:
        """Write the epoch LoRA, or with ``at_step`` the step LoRA (save_every_n_steps) (global rank 0);
        returns its path there, None elsewhere. A full fine-tune writes the whole model instead (saving.py).
        With ``ema``, the weights' moving average is written beside it as ``<stem>-ema``, in the same format."""
        path = self._save_weights(epoch, at_step)
        if self.parts.ema is not None:
            with self.parts.ema.applied():
                self._save_weights(epoch, at_step, ema=True)
        return path

    def _save_weights(self, epoch: int, at_step: bool, ema: bool = False) -> Path | None:
        step, run_dir, replace = self.state.global_step, self.run_dir, self.opts.resume is not None
        if self.cfg.adapter is None:
            return save_full_model(self.parts.engine, self.adapter, self.cfg, run_dir, self.reporter, self.topology,
                                   epoch, step, at_step, replace, ema=ema)
        save_dtype = DTYPES[self.cfg.save_dtype] if self.cfg.save_dtype else torch.float32
        sd = gather_lora(self.parts.engine.module, self.topology.dp_rank, save_dtype)
        if not self.topology.is_main:
            return None
        folder = self.lora_folder(run_dir)
        adapter_cfg = {"type": self.cfg.adapter.type, "rank": self.cfg.adapter.rank,
                       "alpha": self.cfg.adapter.alpha or self.cfg.adapter.rank,
                       "dropout": self.cfg.adapter.dropout, "target_blocks": list(self.adapter.lora_block_prefixes),
                       "target_modules": self.cfg.adapter.target_modules, "model_type": self.cfg.model.type,
                       "decompose_factor": self.cfg.adapter.decompose_factor}
        run_toml = without_secrets(run_dir.run_toml.read_text())   # the LoRA's folder is the one users share
        stem = weights_stem(run_dir.name, epoch, step, at_step, ema)
        info = {"epoch": epoch, "step": step, "run": run_dir.name, **({"ema_decay": self.cfg.average_decay} if ema else {})}
        # a resumed run that trains an epoch again (killed after its LoRA, before the checkpoint) rewrites the
        # same file, bit for bit, rather than adding a "-1" copy beside it
        path = write_lora(sd, folder, stem, adapter_cfg, run_toml, info, replace=replace)
        if self.cfg.run_layout == dp_layout.LAYOUT and not ema:
            dp_layout.write_save(run_dir.path, dp_layout.save_name(epoch, step, at_step), path, adapter_cfg,
                                 self.cfg.file.name if self.cfg.file else "config.toml", run_toml)
        # trained on the pinned ComfyUI: announced only once the host's LoRA loader applies every key
        check_saved_lora(path, self.adapter.model_files()["diffusion_model"][0], self.reporter)
        if ema:   # its own event: the epoch list (and the loader node) keep to the plain LoRAs
            self.reporter.event("ema_saved", epoch=epoch, step=step, path=str(path), at_step=at_step)
            return path
        if at_step:   # not an epoch LoRA: its own event, outside the epoch list
            self.reporter.event("step_lora_saved", epoch=epoch, step=step, path=str(path))
            return path
        loras = with_entry(self.reporter.status.get("loras", []), {"epoch": epoch, "step": step, "path": str(path)})
        self.reporter.update(loras=loras)
        self.reporter.event("lora_saved", epoch=epoch, step=step, path=str(path))
        log.info("saved epoch %d LoRA: %s", epoch, path)
        return path

    def lora_folder(self, run_dir: RunDir) -> Path:
        return Path(self.cfg.lora_dir) if self.cfg.lora_dir else run_dir.loras

    def render_samples(self, lora_path: Path | None, epoch: int) -> None:
        """Sample images with the fresh LoRA (see backend/sampling/render.py); every rank waits for rank 0."""
        from .epoch_samples import render_epoch_samples

        render_epoch_samples(self.cfg, self.run_dir, self.reporter, self.topology.is_main, lora_path, epoch,
                             self.state.global_step, self.stopping)

    def _peer_silent(self, rank: int, seconds: float, again: bool) -> None:
        """From the peer watch thread (``peer_watch.py``): ``rank`` has sent no heartbeat for ``seconds``."""
        message = (f"rank {rank} has not answered for {seconds:.0f} s: its process may be stopped (SIGSTOP, a "
                   "debugger), hung or out of memory; the other ranks wait for it until the process group's timeout")
        if not self.topology.is_main:
            log.warning("rank %d: %s", self.topology.rank, message)
            return
        log.warning("%s", message)
        self.reporter.warn(f"rank-{rank}", message, rank=rank, silent_s=round(seconds))

    def _peer_answers(self, rank: int, seconds: float) -> None:
        message = f"rank {rank} answers again after {seconds:.0f} s"
        log.warning("%s%s", "" if self.topology.is_main else f"rank {self.topology.rank}: ", message)
        if self.topology.is_main:
            self.reporter.event("peer", rank=rank, message=message, silent_s=round(seconds))
            self.reporter.clear_warning(f"rank-{rank}")

    def _on_launcher_gone(self, pid: int) -> None:
        """From the watch thread: the launcher is gone, so nobody can stop this rank or gather the others; exit
        at once (rank 0 first marks the run failed; its last checkpoint stays resumable)."""
        name = self.run_dir.name if self.run_dir is not None else "<run>"
        rank = self.topology.rank
        message = (f"the DeepSpeed launcher (pid {pid}) has ended: rank {rank} exits without a checkpoint. "
                   f"Resume from the last checkpoint with --resume {name}")
        log.error(message)
        try:
            if rank == 0 and self.reporter is not None:
                self.reporter.fail(message)
        finally:
            os._exit(1)

    def _launcher_gone_from_watch(self, pid: int) -> None:
        """A SIGTERM to the whole process group ends DeepSpeed's runner as it reaches this rank: a stop asked for
        then while training checkpoints at the next step first (the main thread ends the process), unless that takes
        too long; before training there is nothing to save."""
        time.sleep(POLL_S)
        if self.signals is not None and self.signals.requested and self.parts is not None:   # training: a checkpoint
            time.sleep(STOP_GRACE_S)
        self._on_launcher_gone(pid)

    def _stop_caching(self, signum: int) -> None:
        """From the signal thread, caching alone (the Cache node's Cancel): end now, not after the image being
        encoded (minutes on a CPU), but between two file writes: every cache entry and record is whole, and what
        is cached so far is kept."""
        log.info("caching stopped: %s received; what is cached so far is kept", describe(signum))
        exit_between_writes(128 + signum)

    def _stop_at_once(self, signum: int) -> None:
        """From the signal thread, on a second signal: end this rank now, without a checkpoint."""
        name = self.run_dir.name if self.run_dir is not None else "<run>"
        message = (f"a second {describe(signum)} stopped the run at once, without a checkpoint: resume from the last "
                   f"checkpoint with --resume {name}")
        log.error(message)
        try:
            if self.topology is not None and self.topology.is_main and self.reporter is not None:
                self.reporter.event("stopped", step=self.state.global_step, epoch=self.state.epoch, at_once=True,
                                    signal=signal.Signals(signum).name)
                self.reporter.update(state="stopped", stop_signal=int(signum), stop_reason=message)
        finally:
            os._exit(128 + signum)
