# SPDX-License-Identifier: GPL-3.0-or-later
"""The launcher: a small state machine over run directories.

It starts runs detached, records their process in the run folder's ``launcher.json`` (atomically), finds live runs
again after a ComfyUI restart, stops them gracefully and refuses a run on GPUs that a live run holds.
A run is "stopped" only once its processes are gone.

Stopping follows the backend's contract: the ``<run_dir>/stop`` file, checked after every step, makes the
ranks checkpoint and exit; after ``stop_timeout`` the ranks get SIGTERM (their handler sets the same flag);
after ``kill_timeout`` more the whole process group gets SIGKILL. The other requests to a live run (save or
sample now, stop after this epoch, a new learning rate) are files in its ``control/`` folder
(``backend/run/control.py``), taken by the run at its next step; they never escalate. A stopped run with a
checkpoint resumes as ``deepspeed ... --module pipetrain train <run_dir>/run.toml --resume <run id>``.

A run on several machines (``[cluster]``) starts as ``python -m pipetrain launch`` would, through
``backend/process/cluster.py``: one detached launcher command for pdsh/slurm/openmpi; for ``no_ssh`` node 0 starts here
and the other nodes' commands are recorded (``launcher.json`` ``node_commands``, the log, the run's route) for
the user to run. Only this machine's slots count as held GPUs. The shared ``stop`` file reaches every node
(global rank 0 reads it and tells the others); the SIGTERM/SIGKILL escalation reaches this machine's processes.
"""
from __future__ import annotations

import dataclasses
import logging
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Callable

from ..backend.run import control as run_control
from ..backend.process.cluster import launch_environment, node_commands, prepare_run_folder, read_hosts
from ..backend.config import load_run_config
from ..backend.errors import PipeTrainError
from ..backend.run.folder import RunDir, RunsRoot, new_run_id
from .build import write_config
from .auto_parallel import planned_stages
from .cluster_form import check_cluster, cluster_hosts, join_command, local_devices
from .procs import ProcessRef, child_env, deepspeed_argv, package_path, spawn, visible_gpu_count
from .queue_plan import MEMO_FOLDER, plan_queued_run
from .summaries import details, file_identity, summarize
from .specs import TrainSpec

log = logging.getLogger(__name__)


class LauncherError(PipeTrainError):
    pass


def check_own_config(run_dir: RunDir, root: Path) -> None:
    """Before a resume runs what the run folder holds: the folder holds no link (``RunDir.check_no_links``), and its
    config resumes this very folder (its output_dir is ``root``, the runs folder): a
    run.toml put there naming another output_dir would resume, and run, a folder elsewhere."""
    run_dir.check_no_links()
    cfg = load_run_config(run_dir.run_toml, check_dataset=False)
    if cfg.resolve(cfg.output_dir).resolve() != Path(root).resolve():
        raise LauncherError(f"run {run_dir.name}: its run.toml's output_dir is not {root}, the runs folder it lies "
                            "in, so it would resume another folder: PipeTrain did not write that run.toml; start a "
                            "new run")


# what the Run Control node offers (nodes reach the backend through the launcher here)
CONTROL_ACTIONS, CONTROL_LR, CONTROL_MAX_LR = run_control.ACTIONS, run_control.LR, run_control.MAX_LR


class Launcher:
    def __init__(self, runs_root: Path, *, lora_root: Path | None = None, comfyui_root: Path | None = None,
                 before_launch: Callable[[tuple[int, ...]], None] | None = None,
                 gpu_count: Callable[[], int] | None = None,
                 stop_timeout: float = 300.0, kill_timeout: float = 60.0):
        self.dirs = RunsRoot(runs_root)
        self.dirs.root.mkdir(parents=True, exist_ok=True)
        self.lora_root = Path(lora_root) if lora_root else None
        self.comfyui_root = comfyui_root
        self.before_launch = before_launch
        self.gpu_count = gpu_count or visible_gpu_count
        self.stop_timeout, self.kill_timeout = stop_timeout, kill_timeout
        self.procs: dict[str, ProcessRef] = {}   # runs whose processes may be alive
        self.queue_plans: dict[str, str] = {}     # run id -> the memory plan shown when it was queued
        # runs found without a live process, with their launcher.json's identity then: another launcher (the CLI,
        # a second ComfyUI) may record a process for the run later, and a rewritten file means look again
        self.dead: dict[str, list[int] | None] = {}
        self.deadlines: dict[str, tuple[float, int]] = {}   # run id -> (when, signal to send)
        self.lock = threading.RLock()
        self.reattach()

    # --- discovery ---------------------------------------------------------------------------
    def reattach(self) -> list[str]:
        """Pick up the live runs recorded under the root (after a ComfyUI restart); returns their ids."""
        found = []
        with self.lock:
            for run_id in self.dirs.ids():
                if run_id not in self.procs and self.alive(run_id):
                    found.append(run_id)
        return found

    def alive(self, run_id: str) -> bool:
        """Whether the run's processes are running; a run never seen before is looked up in its files."""
        with self.lock:
            ref = self.procs.get(run_id)
            run = self.dirs.run(run_id)
            recorded = file_identity(run.launcher_file)
            if ref is None and (run_id not in self.dead or self.dead[run_id] != recorded):
                ref = ProcessRef.from_dict(run.read_launcher().get("process", {}))
                if ref is not None:
                    self.procs[run_id] = ref
            if ref is not None and ref.alive():
                return True
            self.procs.pop(run_id, None)
            self.dead[run_id] = recorded
            return False

    def held_gpus(self) -> dict[int, str]:
        held = {}
        with self.lock:
            for run_id in self.dirs.ids():
                if self.alive(run_id):
                    for gpu in self.dirs.run(run_id).read_launcher().get("gpus", []):
                        held[int(gpu)] = run_id
        return held

    def list(self) -> list[dict]:
        """Every run's summary; a folder that cannot be read as a run (whatever was put under the runs root) is
        left out, and logged, rather than failing the list."""
        out = []
        for run_id in self.dirs.ids():
            try:
                out.append(summarize(self.dirs, run_id, self.alive(run_id)))
            except Exception as e:   # noqa: BLE001  (one foreign folder must not take the panel's list down)
                log.warning("run folder %s left out of the runs list: %s", self.dirs.root / run_id,
                            type(e).__name__)
        return out

    def get(self, run_id: str) -> dict:
        self._require(run_id)
        return details(self.dirs, run_id, self.alive(run_id))

    def _require(self, run_id: str) -> RunDir:
        run = self.dirs.run(run_id)          # RunIdError on a bad id
        if not self.dirs.exists(run_id):
            raise KeyError(run_id)
        return run

    # --- starting ----------------------------------------------------------------------------
    def start(self, spec: TrainSpec, name: str = "") -> str:
        """Validate, write the run directory and launch ``deepspeed ... pipetrain train``; returns the run id."""
        gpu_count = self.gpu_count()
        spec = dataclasses.replace(spec, parallelism=spec.parallelism.on_machine(gpu_count))
        cluster = spec.parallelism.cluster
        devices = local_devices(cluster.launcher, cluster_hosts(cluster)) if cluster else spec.parallelism.devices
        if cluster is None:
            self._refuse_absent(devices)
        self._refuse_held(devices)
        env, info = self._comfyui_for(spec.model_type) if cluster is None else (None, {})
        run_id = new_run_id(name)
        run_dir = self.dirs.run(run_id)
        lora_dir = self.lora_root / run_id if self.lora_root else None
        try:
            run_toml = write_config(spec, run_dir.path, output_dir=self.dirs.root, run_name=run_id,
                                    lora_dir=lora_dir)
            layout = ""
            if spec.parallelism.auto_stages:
                world = check_cluster(cluster, 1) if cluster else len(devices)
                stages, why = planned_stages(run_toml, None if cluster else tuple(devices), world,
                                             self.dirs.root / MEMO_FOLDER)
                layout = f"pipeline_stages {stages} of {world} rank(s) ({why})\n"
                if stages != spec.parallelism.pipeline_stages:
                    spec = dataclasses.replace(spec, parallelism=spec.parallelism.with_stages(stages))
                    run_toml = write_config(spec, run_dir.path, output_dir=self.dirs.root, run_name=run_id,
                                            lora_dir=lora_dir)
            plan = plan_queued_run(run_toml, None if cluster else tuple(devices), self.dirs.root)
            if plan.refusal:
                raise LauncherError(plan.refusal)
            self.queue_plans[run_id] = layout + plan.text
            run_dir.claim_format()
            if cluster is not None:
                self._launch_cluster(run_id, run_toml, resume=False, name=name or run_id)
            else:
                self.launch(run_id, deepspeed_argv("train", run_toml, devices), devices, name=name or run_id,
                            env=env, info={**info, "memory_plan": layout + plan.text, "cpu": not gpu_count})
        except BaseException:
            # refused before any process started: the folder holds only what was just written (nothing of the
            # user's is lost), and left behind it would be listed as a run
            if not run_dir.launcher_file.exists():
                shutil.rmtree(run_dir.path, ignore_errors=True)
                self.queue_plans.pop(run_id, None)
            raise
        return run_id

    def queue_plan(self, run_id: str) -> str:
        """The memory plan made when ``run_id`` was queued (``queue_plan.py``), for the Train node."""
        return self.queue_plans.get(run_id) or self._require(run_id).read_launcher().get("memory_plan", "")

    def _comfyui_for(self, model_type: str) -> tuple[dict[str, str] | None, dict]:
        """Which ComfyUI trains the run (``backend/parity/fallback.py``), decided once here for its ranks and recorded
        for the Train node; a refusal raises. Where it cannot be decided here, each rank decides."""
        import json

        from ..backend.parity.fallback import CHOICE_ENV, choose_comfyui

        try:
            choice = choose_comfyui(model_type, self.comfyui_root)
        except PipeTrainError:
            return None, {}
        if choice.refused:   # before the run exists: nothing is written
            raise LauncherError(choice.refused)
        env = child_env(Path(choice.path)) | {CHOICE_ENV: json.dumps(choice.event())}
        return env, {"comfyui": {"path": choice.path, "version": choice.version, "pinned": choice.pinned,
                                 "reason": choice.reason}}

    def resume(self, run_id: str) -> None:
        with self.lock:     # two Resume clicks at once: the second finds the first one's process alive
            self._resume(run_id)

    def _resume(self, run_id: str) -> None:
        run_dir = self._require(run_id)
        if self.alive(run_id):
            raise LauncherError(f"run {run_id} is still running")
        run_dir.check_format()
        info = run_dir.read_launcher()
        summary = summarize(self.dirs, run_id, False)
        if run_dir.read_status().get("state") == "finished":
            raise LauncherError(f"run {run_id} has finished: every epoch is trained and saved; start a new run to "
                                "train more")
        if not summary["resumable"]:
            raise LauncherError(f"run {run_id} has no checkpoint to resume from")
        check_own_config(run_dir, self.dirs.root)
        run_dir.clear_stop()
        run_control.clear(run_dir)   # asked of the run that stopped; the resumed one starts without them
        if info.get("cluster"):
            self._launch_cluster(run_id, run_dir.run_toml, resume=True, name=info.get("name", run_id))
            return
        devices = tuple(info.get("gpus") or (0,))
        self._refuse_absent(devices)
        self.launch(run_id, deepspeed_argv("train", run_dir.run_toml, devices, ["--resume", run_id]), devices,
                    name=info.get("name", run_id))

    def _refuse_absent(self, devices) -> None:
        """A rank per GPU index: an index this machine does not have would fail in the rank as a CUDA error. A
        machine with no GPU runs its ranks on the CPU, so only a machine with some GPUs refuses."""
        count = self.gpu_count()
        missing = sorted(d for d in devices if d >= count)
        if count and missing:
            raise LauncherError(f"GPU(s) {', '.join(map(str, missing))} asked for, but this machine shows {count} "
                                f"GPU(s) ({', '.join(map(str, range(count)))}): lower `gpus` (and pipeline_stages) "
                                "in the Parallelism node, or choose gpu_ids among these")

    def _refuse_held(self, devices) -> None:
        held = self.held_gpus()
        busy = sorted(set(devices) & set(held))
        if busy:
            runs = ", ".join(sorted({held[g] for g in busy}))
            raise LauncherError(f"GPU(s) {', '.join(map(str, busy))} are in use by run {runs}; stop it first or "
                                f"choose other gpu_ids in the Parallelism node")

    def _launch_cluster(self, run_id: str, run_toml: Path, *, resume: bool, name: str) -> ProcessRef:
        """``python -m pipetrain launch`` semantics: the hostfile and ``.deepspeed_env`` in the shared run folder,
        then the one launcher command (pdsh/slurm/openmpi), or node 0's here and the others' recorded (no_ssh)."""
        cfg = load_run_config(run_toml)
        hosts = read_hosts(cfg)
        hostfile = prepare_run_folder(cfg, run_toml.parent)
        commands = node_commands(cfg, run_toml, hostfile, ["--resume", run_id] if resume else [])
        shim = self.dirs.root / ".pythonpath"
        join_env = {"PYTHONPATH": package_path(shim)} | (
            {"COMFYUI_PATH": str(self.comfyui_root)} if self.comfyui_root else {})
        others = [{"node_rank": n.node_rank, "host": n.host, "deepspeed": n.shell(),
                   "command": join_command(run_toml, n.node_rank, resume, join_env)} for n in commands[1:]]
        cc = cfg.cluster
        cluster = {"launcher": cc.launcher, "hosts": [f"{h}:{s}" for h, s in hosts], "master_addr": cc.master_addr,
                   "master_port": cc.master_port}
        if others:
            with open(RunDir(run_toml.parent).log_file, "a") as log:
                log.write(f"[pipetrain] {nodes_text(cluster, others)}\n")
        env = child_env(self.comfyui_root, base=launch_environment(cfg))
        return self.launch(run_id, commands[0].argv, local_devices(cc.launcher, hosts), name=name, env=env,
                           info={"cluster": cluster, "node_commands": others})

    def where(self, run_id: str) -> str:
        """Where a started run runs, for the Train node: its GPUs, or its nodes and the commands left to run."""
        info = self._require(run_id).read_launcher()
        if not info.get("cluster"):
            comfyui = info.get("comfyui") or {}
            ranks = info.get("gpus", [])
            on = f"on the CPU ({len(ranks)} rank(s))" if info.get("cpu") else f"on GPU(s) {ranks}"
            if comfyui.get("pinned"):
                return f"{on}, with PipeTrain's pinned ComfyUI {comfyui.get('version')} ({comfyui.get('reason')})"
            return on
        return nodes_text(info["cluster"], info.get("node_commands") or [], info.get("gpus", []))

    def launch(self, run_id: str, argv: list[str], devices: tuple[int, ...], name: str | None = None, *,
               env: dict[str, str] | None = None, info: dict | None = None) -> ProcessRef:
        """Spawn ``argv`` detached for run ``run_id`` (the lower half of ``start``/``resume``); ``env`` replaces
        the default child environment; ``info`` adds fields to ``launcher.json``."""
        with self.lock:
            self._refuse_held(devices)
            run_dir = self.dirs.run(run_id)
            run_dir.path.mkdir(parents=True, exist_ok=True)
            if self.before_launch is not None:
                self.before_launch(tuple(devices))
            old = run_dir.read_launcher()
            status_before = file_identity(run_dir.status_file)   # until it changes, the status is the old one
            log = run_dir.log_file
            env = env or child_env(self.comfyui_root)
            ref = spawn(argv, cwd=run_dir.path, log_path=log, env=env)
            run_dir.write_launcher({
                "id": run_id, "name": name or old.get("name") or run_id, "created": old.get("created", time.time()),
                "launched": time.time(), "launches": old.get("launches", 0) + 1, "command": argv,
                "gpus": list(devices), "log": str(log), "process": ref.as_dict(), "status_before": status_before,
                **(info or {})})
            self.procs[run_id] = ref
            self.dead.pop(run_id, None)
            self.deadlines.pop(run_id, None)
            return ref

    # --- stopping ----------------------------------------------------------------------------
    def stop(self, run_id: str, *, kill: bool = False) -> dict:
        """Graceful stop (the backend checkpoints and exits), escalating to SIGTERM then SIGKILL."""
        run_dir = self._require(run_id)
        if not self.alive(run_id):
            raise LauncherError(f"run {run_id} is not running")
        if kill:
            return self.kill(run_id)
        with self.lock:
            run_dir.request_stop()
            self._update_info(run_dir, stop_requested=time.time())
            # a second Stop keeps the first one's escalation time
            self.deadlines.setdefault(run_id, (time.monotonic() + self.stop_timeout, signal.SIGTERM))
        return summarize(self.dirs, run_id, True)

    def control(self, run_id: str, action: str, lr=None) -> dict:
        """Ask a live run for ``action`` (``run_control.ACTIONS``; ``lr`` with "lr"); the run acts at its next step.
        ``ControlValueError`` for a request that is never valid, ``LauncherError`` for one this run refuses."""
        run_control.check_action(action)
        if action == run_control.LR:
            lr = run_control.check_lr(lr)
        run_dir = self._require(run_id)
        if not self.alive(run_id):
            raise LauncherError(f"run {run_id} is not running")
        if action == run_control.SAMPLE and not has_samples(run_dir):
            raise LauncherError(f"run {run_id} has no sample prompts: add a Samples node to the Train node (or "
                                "[samples] to its config) for the next run")
        with self.lock:
            request = run_control.request(run_dir, action, lr)
        return summarize(self.dirs, run_id, True) | {"requested": request}

    def kill(self, run_id: str) -> dict:
        run_dir = self._require(run_id)
        with self.lock:
            self._update_info(run_dir, killed=time.time())
            self.alive(run_id)
            ref = self.procs.get(run_id)
            if ref is not None:
                ref.signal_group(signal.SIGKILL)
            self.deadlines.pop(run_id, None)
        self.wait(run_id, 10)
        return summarize(self.dirs, run_id, self.alive(run_id))

    def wait(self, run_id: str, timeout: float) -> bool:
        """True once the run's processes are gone (polling, at most ``timeout`` seconds)."""
        end = time.monotonic() + timeout
        while self.alive(run_id):
            if time.monotonic() > end:
                return False
            time.sleep(0.05)
        return True

    def poll(self) -> None:
        """Escalate overdue stops and forget finished processes; called by the relay thread."""
        now = time.monotonic()
        with self.lock:
            for run_id, (when, sig) in list(self.deadlines.items()):
                ref = self.procs.get(run_id)
                if ref is None or not ref.alive():
                    self.deadlines.pop(run_id, None)
                elif now >= when:
                    if sig == signal.SIGTERM:
                        # the ranks' SIGTERM handler sets the stop flag (checkpoint, exit 0). DeepSpeed's
                        # launch.py would answer a SIGTERM by killing the ranks 30 s later, so it is left out.
                        ref.signal_ranks(sig) or ref.signal_group(sig)
                    else:
                        ref.signal_group(sig)
                    if sig == signal.SIGTERM:
                        self.deadlines[run_id] = (now + self.kill_timeout, signal.SIGKILL)
                    else:
                        self._update_info(self.dirs.run(run_id), killed=time.time())
                        self.deadlines.pop(run_id, None)

    def _update_info(self, run_dir: RunDir, **fields) -> None:
        info = run_dir.read_launcher()
        info.update(fields)
        run_dir.write_launcher(info)


def has_samples(run_dir: RunDir) -> bool:
    """Whether the run's config asks for sample images (``[samples]``)."""
    import tomllib

    from ..backend.config.files import MAX_CONFIG
    from ..backend.fsutil import read_regular
    try:   # a regular file of bounded size: the route that asks runs on a server
        return isinstance(tomllib.loads(read_regular(run_dir.run_toml, MAX_CONFIG).decode()).get("samples"), dict)
    except (OSError, ValueError):   # UnreadableFile, UnicodeDecodeError and TOMLDecodeError are ValueErrors
        return False


def nodes_text(cluster: dict, joins: list[dict], gpus: list[int] | None = None) -> str:
    """A cluster run in words: its nodes, and for ``no_ssh`` the command each other node must run."""
    hosts = cluster.get("hosts", [])
    text = f"on {len(hosts)} nodes ({cluster.get('launcher')}: {', '.join(hosts)})"
    if gpus:
        text += f", GPU(s) {gpus} of this machine"
    if joins:
        text += ("; node 0 starts here and waits for the others: run on each other node (same paths, shared "
                 "run folder)") + "".join(f"\n# node {j['node_rank']} ({j['host']}):\n{j['command']}" for j in joins)
    return text
