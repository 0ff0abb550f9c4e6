# SPDX-License-Identifier: GPL-3.0-or-later
"""``python -m pipetrain deepspeed ARGS``: DeepSpeed's launcher (what ``deepspeed ARGS`` runs), in this process,
with an exit status that says whether the run finished.

DeepSpeed's runner exits 0 whenever its ``launch.py`` ends without an error of its own, a ``launch.py`` killed by a
signal included, though the ranks it started never finished. Here global rank 0 names its run folder in a file
this process chose (``RUN_DIR_NOTE_ENV``), and the run's status decides: finished (or, for ``cache``, cached) is 0,
a stop asked for through the run folder is 0, a stop by a signal is 128 + the signal's number, anything else is
non-zero with one line saying why. SIGINT and SIGTERM are passed to the ranks only (they checkpoint at the next
step and stop, ``train/stop_signals.py``): DeepSpeed's runner would die of them and leave the ranks to end without
a checkpoint when they see it gone, and its ``launch.py`` kills the ranks if they take long."""
from __future__ import annotations

import os
import signal
import sys
import tempfile
import traceback
from contextlib import contextmanager
from pathlib import Path

RUN_DIR_NOTE_ENV = "PIPETRAIN_RUN_DIR_NOTE"
RANK_FLAG = "--local_rank="
_ENDED_AS_ASKED = {"finished", "cached"}


def note_run_dir(run_dir: Path) -> None:
    """Global rank 0: tell the launching CLI which folder the run writes (nothing when not launched by it)."""
    note = os.environ.get(RUN_DIR_NOTE_ENV)
    if note:
        Path(note).write_text(str(run_dir))


def ranks_among(processes) -> list:
    """The training ranks among ``processes`` (psutil): DeepSpeed's ``launch.py`` starts each with
    ``--local_rank=N``; a process gone meanwhile is left out."""
    import psutil

    found = []
    for p in processes:
        try:
            if any(arg.startswith(RANK_FLAG) for arg in p.cmdline()):
                found.append(p)
        except psutil.Error:
            continue
    return found


def _ranks() -> list:
    import psutil

    return ranks_among(psutil.Process().children(recursive=True))


def _pass_to_ranks(signum, frame) -> None:
    import psutil

    for rank in _ranks():
        try:
            rank.send_signal(signum)
        except psutil.Error:
            continue


@contextmanager
def signals_to_ranks():
    """While DeepSpeed's runner runs in this process: SIGINT and SIGTERM go to the ranks below it, not to the runner
    (main thread only, Python's rule for signal handlers). DeepSpeed's pdsh runner of several nodes sets its own
    (it stops the other nodes' processes), which wins over these while it runs."""
    previous = {sig: signal.signal(sig, _pass_to_ranks) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def outcome(run_dir: str | None, launcher_status: int) -> tuple[int, str | None]:
    """(exit status, the line that says why the run did not finish, or None) from the run's status."""
    from ..run.folder import RunDir, read_json

    if run_dir is None:
        return (launcher_status or 1), "no run started (see the errors above)"
    run = RunDir(Path(run_dir))
    status = read_json(run.status_file)
    state = status.get("state")
    if state in _ENDED_AS_ASKED:
        return 0, None
    if state == "stopped":
        signum = status.get("stop_signal")
        if isinstance(signum, int) and not isinstance(signum, bool) and 0 < signum < 64:
            return 128 + signum, f"the run in {run} stopped on {signal.Signals(signum).name}: {status.get('stop_reason')}"
        return 0, None
    if state == "failed" and status.get("error"):
        why = str(status["error"]).splitlines()[0]
    else:
        why = (f"its status is still {state!r}: its DeepSpeed launcher ended before the run did (killed?). Resume "
               f"it with --resume {run.name}")
    return (launcher_status if launcher_status > 0 else 1), f"the run in {run} did not finish: {why}"


def _runner_status(runner, args: list[str]) -> int:
    """DeepSpeed's runner on ``args`` in this process: the status it exits with (it ends with sys.exit(code))."""
    try:
        runner.main(args)
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


def run_runner(argv: list[str], cwd: Path, env: dict[str, str]) -> int:
    """A ``command_lines.deepspeed_command`` run by DeepSpeed's runner in this process, in ``cwd`` (where the runner
    reads ``.deepspeed_env``) with ``env``: the exit status its own process would end with (a Python error's
    traceback on stderr and 1). A process that has loaded a run's config has paid for torch, which the runner
    imports: an interpreter of its own would import it again before starting anything. SIGINT and SIGTERM go to the
    ranks meanwhile, as under ``python -m pipetrain deepspeed``."""
    from .command_lines import runner_prefix

    prefix = runner_prefix()
    if argv[:len(prefix)] != prefix:
        raise ValueError(f"not a DeepSpeed runner command: {argv[:len(prefix)]}")
    from deepspeed.launcher import runner

    before_env, before_cwd = dict(os.environ), os.getcwd()
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)   # the runner's log lines keep their place among its children's
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    try:
        with signals_to_ranks():
            return _runner_status(runner, argv[len(prefix):])
    except Exception:  # noqa: BLE001  (as an uncaught error ends the runner's own process)
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        os.chdir(before_cwd)
        os.environ.clear()
        os.environ.update(before_env)


def main(args: list[str]) -> int:
    from deepspeed.launcher import runner

    from .command_lines import ENTRY
    from .dp_cli import script_as_command

    args = script_as_command(args, str(ENTRY))   # diffusion-pipe's `deepspeed ... train.py --deepspeed --config X`
    with tempfile.TemporaryDirectory(prefix="pipetrain-launch-") as tmp:
        note = Path(tmp) / "run_dir"
        os.environ[RUN_DIR_NOTE_ENV] = str(note)
        try:
            with signals_to_ranks():
                launcher_status = _runner_status(runner, args)
        finally:
            os.environ.pop(RUN_DIR_NOTE_ENV, None)
        run_dir = note.read_text() if note.is_file() else None
    status, why = outcome(run_dir, launcher_status)
    if why is not None:
        print(f"pipetrain: {why}", file=sys.stderr, flush=True)
    return status
