"""How a bench run's ranks start: under DeepSpeed's launcher (what the GPU machine does, and the default), or forked
from the test suite's warm-rank server where ``PIPETRAIN_BENCH_WARM_RANKS`` names the socket it listens on
(``tests/warm_ranks.py``: torch, DeepSpeed and ComfyUI imported once, not by four fresh interpreters a run). The tests
of the harness set it for its subprocesses; a test about killing the launcher's process tree leaves it unset.

Either way the caller gets a handle to poll, wait for or kill with every rank of the run, and the ranks' output lands
in the log file."""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import time
from pathlib import Path

WARM_RANKS_ENV = "PIPETRAIN_BENCH_WARM_RANKS"
NEEDS_LAUNCH = 97   # the warm ranks' exit status when another ComfyUI than the server's trains the config


def start_ranks(command: str, config: Path, ranks: int, extra: list[str], log: Path, env: dict[str, str]):
    """``pipetrain COMMAND CONFIG EXTRA...`` on ``ranks`` ranks in the config's folder, its output into ``log``
    (truncated first)."""
    address = env.get(WARM_RANKS_ENV)
    if address:
        run = WarmRun.start(address, [command, str(config), *extra], ranks, config.parent, env, log)
        if run is not None:
            return run
    return LaunchedRun(command, config, ranks, extra, log, env)


class LaunchedRun:
    """DeepSpeed's runner, its launcher and the ranks, in the caller's process group (whoever kills that group
    takes them too)."""

    def __init__(self, command: str, config: Path, ranks: int, extra: list[str], log: Path, env: dict[str, str]):
        from pipetrain.backend.process.command_lines import deepspeed_command

        self._log = open(log, "w")
        self._proc = subprocess.Popen(deepspeed_command(command, config, ranks, extra), cwd=config.parent,
                                      stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def poll(self) -> int | None:
        rc = self._proc.poll()
        if rc is not None:
            self._log.close()
        return rc

    def wait(self) -> int:
        self._proc.wait()
        return self.poll()

    def kill(self) -> None:
        kill_tree(self._proc)
        self._log.close()


class WarmRun:
    """Ranks forked by the warm-rank server at ``address`` into one process group; the server answers the group
    once they run and their exit status once they are gone (as DeepSpeed's runner gives it)."""

    def __init__(self, conn: socket.socket, relaunch):
        self._conn, self._stream, self._relaunch = conn, conn.makefile("r"), relaunch
        self._group: int | None = None
        self._code: int | None = None
        self._launched: LaunchedRun | None = None

    @classmethod
    def start(cls, address: str, argv: list[str], ranks: int, cwd: Path, env: dict[str, str], log: Path):
        """The run, or None where the server refuses it (another start environment than its own)."""
        Path(log).write_text("")    # the ranks append to it
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(address)
        conn.sendall((json.dumps({"argv": argv, "ranks": ranks, "cwd": str(cwd), "env": env, "log": str(log)})
                      + "\n").encode())
        command, config, *extra = argv
        run = cls(conn, lambda: LaunchedRun(command, Path(config), ranks, extra, log, env))
        run._group = run._answer(300.0).get("group")
        if run._group is None:
            run._close()
            return None
        return run

    def _answer(self, timeout: float) -> dict:
        if not select.select([self._conn], [], [], timeout)[0]:
            raise TimeoutError(f"the warm-rank server did not answer within {timeout:.0f} s")
        line = self._stream.readline()
        if not line:
            raise ConnectionError("the warm-rank server closed the connection")
        return json.loads(line)

    def _close(self) -> None:
        self._stream.close()
        self._conn.close()

    def poll(self) -> int | None:
        if self._launched is not None:
            return self._launched.poll()
        if self._code is None and select.select([self._conn], [], [], 0)[0]:
            self._code = self._answer(0)["returncode"]
            self._close()
            if self._code == NEEDS_LAUNCH:   # its ranks wrote nothing: the run starts under DeepSpeed's launcher
                self._launched = self._relaunch()
                return None
        return self._code

    def wait(self) -> int:
        while (rc := self.poll()) is None:
            time.sleep(0.2)
        return rc

    def kill(self) -> None:
        if self._launched is not None:
            return self._launched.kill()
        if self._code is None:
            try:
                os.killpg(self._group, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._code = self._answer(60.0)["returncode"]   # the server reaped them: gone before the next run
            self._close()


def kill_tree(proc: subprocess.Popen) -> None:
    """Kill a process and every process under it (DeepSpeed's launcher, its per-node launcher and the ranks)."""
    import psutil

    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for p in [*tree, proc]:
        try:
            p.kill()
        except (psutil.NoSuchProcess, ProcessLookupError):
            pass
    proc.wait()
    psutil.wait_procs(tree, timeout=60)   # gone, and their GPU memory with them, before the next run starts
