"""The DeepSpeed launcher command line for a PipeTrain run (one place, used by the CLI demo, the
ComfyUI launcher and the tests)."""
from __future__ import annotations

import socket
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_command(command: str, config: Path, num_ranks: int, extra: list[str] = (),
                      master_port: int | None = None, launcher_args: list[str] = ()) -> list[str]:
    """``deepspeed --num_gpus N --module pipetrain COMMAND CONFIG ...`` with this interpreter."""
    return [sys.executable, "-u", "-m", "deepspeed.launcher.runner", "--num_gpus", str(num_ranks),
            "--master_port", str(master_port or free_port()), *launcher_args,
            "--module", "pipetrain", command, str(config), *extra]
