# SPDX-License-Identifier: GPL-3.0-or-later
"""Detached processes: spawn in a new session, find them again after a restart, signal their group.

A process is identified by (pid, creation time) so that a recycled pid is never mistaken for a run.
"""
from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import psutil

from ..backend.process.deepspeed_cli import ranks_among

REPO = Path(__file__).resolve().parents[1]


@dataclass
class ProcessRef:
    pid: int
    pgid: int
    create_time: float
    popen: subprocess.Popen | None = None   # only in the ComfyUI process that spawned it (reaps the zombie)

    def as_dict(self) -> dict:
        return {"pid": self.pid, "pgid": self.pgid, "create_time": self.create_time}

    @classmethod
    def from_dict(cls, d: dict) -> "ProcessRef | None":
        try:
            return cls(int(d["pid"]), int(d["pgid"]), float(d["create_time"]))
        except (KeyError, TypeError, ValueError):
            return None

    def leader_alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        try:
            p = psutil.Process(self.pid)
            return abs(p.create_time() - self.create_time) < 0.05 and p.status() != psutil.STATUS_ZOMBIE
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return False

    def group_members(self) -> list[psutil.Process]:
        """Live processes of the run's process group (ranks may outlive a killed launcher)."""
        found = []
        for p in psutil.process_iter(["pid", "status"]):
            try:
                if p.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(p.pid) == self.pgid:
                    found.append(p)
            except (ProcessLookupError, psutil.Error, OSError):
                continue
        return found

    def alive(self) -> bool:
        return self.leader_alive() or (self._group_is_ours() and bool(self.group_members()))

    def ranks(self) -> list[psutil.Process]:
        """The training ranks of the group."""
        return ranks_among(self.group_members() if self._group_is_ours() else [])

    def signal_ranks(self, sig: int) -> bool:
        """Signal only the ranks (not DeepSpeed's launchers); False when the group has none."""
        ranks = self.ranks()
        for p in ranks:
            try:
                p.send_signal(sig)
            except psutil.Error:
                continue
        return bool(ranks)

    def _group_is_ours(self) -> bool:
        # the group id is the leader's pid; only trust it while the leader's identity is not reused
        try:
            p = psutil.Process(self.pgid)
            return abs(p.create_time() - self.create_time) < 0.05
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return True

    def signal_group(self, sig: int) -> bool:
        if not self.alive():
            return False
        try:
            os.killpg(self.pgid, sig)
            return True
        except ProcessLookupError:
            return False
        finally:
            if self.popen is not None:
                self.popen.poll()


def spawn(argv: list[str], *, cwd: Path, log_path: Path, env: dict[str, str]) -> ProcessRef:
    """Start ``argv`` detached (own session and process group), output appended to ``log_path``."""
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(argv, cwd=str(cwd), env=env, stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
    try:
        ctime = psutil.Process(popen.pid).create_time()
    except psutil.NoSuchProcess:  # exited already; still a zombie we can reap
        ctime = 0.0
    return ProcessRef(popen.pid, popen.pid, ctime, popen)


def package_path(shim_dir: Path) -> str:
    """A folder to put on PYTHONPATH so that ``import pipetrain`` finds this repository (for the commands a multi-node
    run prints for its other nodes; PipeTrain's own processes need none)."""
    if REPO.name == "pipetrain":
        return str(REPO.parent)
    shim_dir.mkdir(parents=True, exist_ok=True)
    link = shim_dir / "pipetrain"
    if not (link.is_symlink() and link.resolve() == REPO):
        tmp = shim_dir / f".pipetrain.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(REPO, target_is_directory=True)
        os.replace(tmp, link)
    return str(shim_dir)


def child_env(comfyui_root: Path | None, base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) + ComfyUI's location. The package needs no PYTHONPATH:
    children run the entry file by its path (``backend.process.command_lines.pipetrain_command``)."""
    env = dict(os.environ if base is None else base)
    if comfyui_root is not None:
        env["COMFYUI_PATH"] = str(comfyui_root)
    env["PYTHONUNBUFFERED"] = "1"
    # ``python -m`` would put the working folder (the run folder) first on sys.path, in the launcher and in every
    # rank it starts: nothing in a run folder is ever imported
    env["PYTHONSAFEPATH"] = "1"
    return env


def deepspeed_argv(command: str, config: Path, devices: tuple[int, ...], extra: list[str] = ()) -> list[str]:
    """``python -m pipetrain deepspeed --num_gpus N pipetrain COMMAND CONFIG ...`` (``--include`` for other GPU
    ids): DeepSpeed's runner, with an exit status that says whether the run finished (plain ``deepspeed`` exits 0
    when its launch.py is killed) and SIGTERM passed to the ranks only (``backend/process/deepspeed_cli.py``)."""
    from ..backend.process.command_lines import deepspeed_cli_command

    argv = deepspeed_cli_command(command, config, len(devices), list(extra))
    if tuple(devices) == tuple(range(len(devices))):
        return argv
    i = argv.index("--num_gpus")
    return argv[:i] + ["--include", "localhost:" + ",".join(map(str, devices))] + argv[i + 2:]


def python_argv(*args: str) -> list[str]:
    from ..backend.process.command_lines import pipetrain_command

    return pipetrain_command(*args)


def visible_gpu_count() -> int:
    """The GPUs a run started from this process can use: its children inherit CUDA_VISIBLE_DEVICES (ComfyUI's
    ``--cuda-device`` sets it), so this process's count is theirs."""
    import torch
    return torch.cuda.device_count()
