"""The command lines of PipeTrain's own processes (one place, used by the CLI demo, the ComfyUI launcher, the
sample renderer and the tests)."""
from __future__ import annotations

import socket
import sys
from pathlib import Path

# Started by its path, not as ``-m pipetrain``: the package need not be importable by that name (a clone in
# ComfyUI's custom_nodes/ is imported under a module name made of its folder's path), and the child runs the
# very copy of the code its parent runs.
ENTRY = Path(__file__).resolve().parents[2] / "__main__.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pipetrain_command(*args: str) -> list[str]:
    """``python -m pipetrain ARGS`` with this interpreter, through the entry file."""
    return [sys.executable, "-u", str(ENTRY), *args]


def runner_prefix() -> list[str]:
    """How a ``deepspeed_command`` starts DeepSpeed's runner: this interpreter, unbuffered, its module."""
    return [sys.executable, "-u", "-m", "deepspeed.launcher.runner"]


def deepspeed_command(command: str, config: Path, num_ranks: int, extra: list[str] = (),
                      master_port: int | None = None, launcher_args: list[str] = ()) -> list[str]:
    """``deepspeed --num_gpus N pipetrain COMMAND CONFIG ...`` with this interpreter (each rank runs the entry
    file)."""
    return [*runner_prefix(), "--num_gpus", str(num_ranks), "--master_port", str(master_port or free_port()),
            *launcher_args, str(ENTRY), command, str(config), *extra]


def deepspeed_cli_command(command: str, config: Path, num_ranks: int, extra: list[str] = ()) -> list[str]:
    """``deepspeed_command`` through ``python -m pipetrain deepspeed`` (``process/deepspeed_cli.py``): the same run, and
    an exit status that says whether it finished."""
    runner = deepspeed_command(command, config, num_ranks, extra)
    return pipetrain_command("deepspeed", *runner[len(runner_prefix()):])
