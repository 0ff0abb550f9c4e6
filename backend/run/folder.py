"""The run folder: the one contract between the process that trains and the processes that watch it (the
launcher, the ComfyUI panel, the CLI). A run is ``<runs root>/<run id>/``; this module names every file in
it, holds the run-id rules and the folder's format version, chooses the folder a training run writes and
locks it to one live writer. Nothing else spells a run folder's file names.

The training side writes ``run.toml``/``dataset.toml`` (its config), ``status.json`` (the latest state,
rewritten atomically), ``events.jsonl`` (one JSON object a line), ``checkpoints/``, ``loras/``, ``models/``,
``tensorboard/``; the launcher writes ``launcher.json`` (its process record) and ``log.txt``, asks a
run to stop with the ``stop`` file and for the rest (save or sample now, stop after the epoch, a new learning
rate) with files in ``control/``. Reading a run never needs its process alive.

Run ids are validated by a strict pattern and the resolved folder must lie directly inside the root, so
nothing outside the run folders is read or written through an id.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import stat
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from ..errors import ConfigError, PipeTrainError
from ..fsutil import atomic_write_json, read_regular

# The layout version, written into each run folder (``FORMAT_FILE``). Raise it when a file changes meaning or
# moves, so a PipeTrain meets a folder it cannot read with a clear message instead of a misreading.
FORMAT = 1
FORMAT_FILE = "format.json"
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,79}$")
CACHE = "cache"            # the shared cache folder under the runs root (also where caching alone reports)
RESERVED = {CACHE}


class RunIdError(ValueError):
    pass


class RunFormatError(PipeTrainError):
    pass


class RunDirBusy(PipeTrainError):
    pass


def check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id) or run_id in RESERVED:
        raise RunIdError(f"invalid run id {run_id!r}: use letters, digits, '-' and '_' only (at most 80)")
    return run_id


def new_run_id(prefix: str = "") -> str:
    """``[<prefix>-]<local date>-<time>-<4 hex digits>``: unique without looking at the root, sortable by time."""
    prefix = re.sub(r"[^A-Za-z0-9_-]+", "-", prefix).strip("-_")[:40]
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return check_run_id(f"{prefix + '-' if prefix else ''}{stamp}-{secrets.token_hex(2)}")


MAX_RECORD = 16 * 1024 * 1024   # status.json, launcher.json: a record, never more


def read_object(path: Path) -> dict | None:
    """A run folder's JSON record, or None where it is missing, not a regular file, too large or not an object:
    anything may have been put in a run folder, and the panel reads it on every poll."""
    try:
        data = json.loads(read_regular(path, MAX_RECORD))
    except (OSError, ValueError, RecursionError):    # UnreadableFile is a ValueError
        return None
    return data if isinstance(data, dict) else None


def read_json(path: Path) -> dict:
    """``read_object``, {} for None."""
    found = read_object(path)
    return {} if found is None else found


def read_events(path: Path, offset: int = 0) -> tuple[list[dict], int]:
    """Complete JSON lines from ``offset``; returns (events, offset after the last complete line)."""
    try:   # a regular file only, checked on the opened file: a FIFO put in its place would block the reader
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return [], offset
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return [], offset
        with os.fdopen(fd, "rb", closefd=False) as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return [], offset
    finally:
        os.close(fd)
    end = data.rfind(b"\n") + 1
    events = []
    for line in data[:end].splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events, offset + end


@dataclass(frozen=True)
class RunDir:
    """One run's folder and the names of what it holds."""
    path: Path

    def __post_init__(self):
        object.__setattr__(self, "path", Path(self.path))

    @property
    def name(self) -> str:
        return self.path.name

    def __str__(self) -> str:
        return str(self.path)

    def __fspath__(self) -> str:   # ``Path(run_dir)`` and ``RunDir(run_dir)`` accept either
        return str(self.path)

    # --- the files ------------------------------------------------------------------------------
    run_toml = property(lambda self: self.path / "run.toml")
    dataset_toml = property(lambda self: self.path / "dataset.toml")
    status_file = property(lambda self: self.path / "status.json")
    events_file = property(lambda self: self.path / "events.jsonl")
    launcher_file = property(lambda self: self.path / "launcher.json")
    log_file = property(lambda self: self.path / "log.txt")
    samples_log = property(lambda self: self.path / "samples.log")
    stop_file = property(lambda self: self.path / "stop")
    lock_file = property(lambda self: self.path / ".lock")
    format_file = property(lambda self: self.path / FORMAT_FILE)
    checkpoints = property(lambda self: self.path / "checkpoints")
    loras = property(lambda self: self.path / "loras")
    models = property(lambda self: self.path / "models")
    tensorboard = property(lambda self: self.path / "tensorboard")
    sample_requests = property(lambda self: self.path / "sample_requests")
    control = property(lambda self: self.path / "control")   # requests to a live run (``run/control.py``)
    # the control changes a run has acknowledged (a new learning rate), replayed by a resume (``run/control.py``)
    controls_file = property(lambda self: self.path / "controls.json")

    def is_run(self) -> bool:
        """A folder some PipeTrain process has made a run of (the launcher's record, a status or a config, each a
        regular file: ComfyUI's SaveImage can make folders of any name under the runs root)."""
        return self.path.is_dir() and any(p.is_file() for p in (self.launcher_file, self.status_file, self.run_toml))

    # --- reading and writing ----------------------------------------------------------------------
    def read_status(self) -> dict:
        return read_json(self.status_file)

    def read_launcher(self) -> dict:
        return read_json(self.launcher_file)

    def write_launcher(self, info: dict) -> None:
        atomic_write_json(self.launcher_file, info)

    def read_events(self, offset: int = 0) -> tuple[list[dict], int]:
        return read_events(self.events_file, offset)

    def started(self) -> float:
        """When the run started (its records' word where it is a number, else the folder's time)."""
        for value in (self.read_launcher().get("created"), self.read_status().get("started")):
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:
                return float(value)
        try:
            return self.path.stat().st_mtime
        except OSError:
            return 0.0

    def latest_checkpoint(self) -> str | None:
        """The checkpoint a resume starts from (the backend's choice: past a dangling ``latest`` too); None where
        the folder cannot be read as one (a ``latest`` that is a folder)."""
        from ..train.checkpoint import latest_tag  # torch: only when asked
        try:
            return latest_tag(self.checkpoints)
        except (OSError, UnicodeDecodeError):
            return None

    # --- stopping ---------------------------------------------------------------------------------
    def request_stop(self) -> None:
        self.stop_file.touch()

    def stop_requested(self) -> bool:
        return self.stop_file.exists()

    def clear_stop(self) -> None:
        self.stop_file.unlink(missing_ok=True)

    # --- the format version -------------------------------------------------------------------------
    def format(self) -> int:
        """The folder's layout version; a folder from before versions were written has the first one."""
        if not self.format_file.exists():
            return 1
        version = read_json(self.format_file).get("format")
        if not isinstance(version, int) or isinstance(version, bool) or not 0 < version < 10 ** 6:
            raise RunFormatError(f"run folder {self.path}: {FORMAT_FILE} is unreadable (no format version in it); "
                                 "it was not written by PipeTrain: start a new run")
        return version

    def check_format(self) -> None:
        version = self.format()
        if version > FORMAT:
            raise RunFormatError(f"run folder {self.path} has format {version}, newer than this PipeTrain reads "
                                 f"(format {FORMAT}): update PipeTrain to resume or read it")
        if version < FORMAT:
            raise RunFormatError(f"run folder {self.path} has format {version}, older than this PipeTrain reads "
                                 f"(format {FORMAT}): resume it with the PipeTrain that started it, or start a "
                                 "new run")

    def claim_format(self) -> None:
        """Check the folder's format, and record this PipeTrain's where none is written yet."""
        self.check_format()
        if not self.format_file.exists():
            self.path.mkdir(parents=True, exist_ok=True)
            atomic_write_json(self.format_file, {"format": FORMAT})

    def check_no_links(self) -> None:
        """A run folder PipeTrain wrote holds no symbolic link (it makes none): a resume appends to its log and
        events, rewrites its lock file and reads its config and checkpoints, so a link in a folder someone sent
        (``.lock`` -> a file of yours) would have it write or read elsewhere. ``RunFormatError`` naming the first."""
        for top, folders, files in os.walk(self.path):   # a linked folder is listed, never entered
            for name in sorted(folders + files):
                path = Path(top) / name
                if path.is_symlink():
                    raise RunFormatError(f"run folder {self.path}: {path.relative_to(self.path)} is a link; "
                                         "PipeTrain makes none in a run folder, and a resume would write or read "
                                         "through it: remove it, or start a new run")

    # --- one live writer ----------------------------------------------------------------------------
    def lock(self):
        """An exclusive lock on the folder's lock file holding this process's pid, kept while the returned file
        stays open (the kernel drops it when the process ends, however it ends)."""
        f = open(self.lock_file, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            text = f.read(32).strip()
            f.close()
            owner = f"pid {text}" if text.isdigit() else "another process"   # never echo the file's content
            raise RunDirBusy(f"run folder {self.path} is in use by a run that is still going ({owner}): wait for it "
                             "to finish or stop it, or give this run another run_name") from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        return f


class RunsRoot:
    """The runs root and the rules for finding a run's folder in it."""

    def __init__(self, root: Path):
        self.root = Path(root).resolve()
        # run id -> ((inode, mtime) of its folder, is a run, started): a folder's mtime changes whenever a file
        # in it is made, renamed over or removed (its records are written atomically), so a listing reads only
        # the folders that changed; listings run on ComfyUI's event loop (the Run combo of /object_info)
        self._seen: dict[str, tuple[tuple[int, int], bool, float]] = {}

    def path(self, run_id: str) -> Path:
        check_run_id(run_id)
        p = (self.root / run_id).resolve()
        if p.parent != self.root:
            raise RunIdError(f"invalid run id {run_id!r}")
        return p

    def run(self, run_id: str) -> RunDir:
        return RunDir(self.path(run_id))

    def exists(self, run_id: str) -> bool:
        try:
            return self.run(run_id).is_run()
        except RunIdError:
            return False

    def ids(self) -> list[str]:
        """Run ids, newest first: the folders directly in the root (not links) that are runs (``is_run``)."""
        seen, found = {}, []
        try:
            entries = list(os.scandir(self.root))
        except OSError:
            return []
        for e in entries:
            if not RUN_ID.fullmatch(e.name) or e.name in RESERVED:
                continue
            try:
                if not e.is_dir(follow_symlinks=False):
                    continue
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            key = (st.st_ino, st.st_mtime_ns)
            known = self._seen.get(e.name)
            if known is None or known[0] != key:
                run = RunDir(self.root / e.name)
                is_run = run.is_run()
                known = (key, is_run, run.started() if is_run else 0.0)
            seen[e.name] = known
            if known[1]:
                found.append((known[2], e.name))
        self._seen = seen
        return [name for _, name in sorted(found, reverse=True)]

    @property
    def cache(self) -> RunDir:
        """The shared cache folder; caching alone reports into it as a run would."""
        return RunDir(cache_folder(self.root))


def cache_folder(output_dir: Path) -> Path:
    return Path(output_dir) / CACHE


def _in_root(out: Path, folder: Path) -> bool:
    """``folder`` is a run folder of the output folder ``out`` itself: a folder directly in it, not a link (which
    could lead anywhere), named as a run id."""
    return (RUN_ID.fullmatch(folder.name) is not None and folder.name not in RESERVED and not folder.is_symlink()
            and folder.is_dir() and folder.resolve().parent == Path(out).resolve())


def _resumed_folder(out: Path, resume: str) -> Path:
    """The folder ``--resume <resume>`` names: a run id, or a path to a run folder directly in ``out`` (the
    config's output_dir). A resume runs what its folder holds (its config, DeepSpeed's checkpoint): any other
    folder, a link out of ``out`` among them, is refused naming ``out``."""
    given = Path(resume).expanduser()
    path = given if given.is_absolute() else out / given
    if not path.is_dir():
        raise ConfigError(f"--resume {resume}: no such run folder in {out} (output_dir); name a run there by its id")
    if not _in_root(out, path):
        raise ConfigError(f"--resume {resume}: not a run folder of the output folder {out} (output_dir): a resume "
                          f"runs what its folder holds, so only runs PipeTrain writes there are resumed; name one "
                          f"by its run id, or copy the run folder into {out} (not a link) and resume it by its "
                          f"name")
    return path


def _nothing_left(run: RunDir, cfg) -> bool:
    """The run finished and this config asks for no more: no more epochs, no higher max_steps. (A finished run
    resumed with more epochs trains on: diffusion-pipe's way of extending a run.)"""
    status = run.read_status() or {}
    if status.get("state") != "finished":
        return False
    more_epochs = cfg.epochs > (status.get("epoch") or 0)   # the epoch its last step was in
    more_steps = cfg.max_steps is not None and cfg.max_steps > (status.get("total_steps") or 0)
    return not (more_epochs or more_steps)


def _resumable(run: RunDir, cfg) -> RunDir:
    """A run to resume, refused when it has finished and the config asks for nothing more: resuming would train
    nothing and save its last epoch again (the panel's Resume route answers 409 for the same reason)."""
    if _nothing_left(run, cfg):
        raise ConfigError(f"--resume {run.name}: that run has finished and this config trains no further (epochs "
                          f"= {cfg.epochs}); raise epochs (or max_steps) to train on, or start a new run without "
                          "--resume")
    return run


def check_unused(run: RunDir, cfg) -> None:
    """A new run (no ``--resume``) never writes into a folder another run has trained in: refused, naming
    ``--resume``, rather than moved to a folder of another name, because ``run_name`` names the folder and the
    LoRA files the user will look for; the old run's files stay as they are. (A folder the launcher prepared
    holds only the config until the run reports.)"""
    if run.status_file.exists() or run.events_file.exists():
        raise ConfigError(f"{run.path} already holds a run: continue it with --resume {run.name}, or give this "
                           "run another run_name (nothing in that folder was changed)", file=cfg.file,
                           key="run_name")


def choose_run_dir(cfg, resume: str | None) -> RunDir:
    """The folder a training run writes: a new one (``run_name``, or a fresh id), or the one to resume (``""``:
    the newest with a checkpoint; a name or path otherwise). Its format is checked and recorded."""
    out = cfg.resolve(cfg.output_dir)
    if cfg.run_name:
        try:
            check_run_id(cfg.run_name)
        except RunIdError as e:
            raise ConfigError(str(e), file=cfg.file, key="run_name") from None
    if resume is None:
        name = cfg.run_name or new_run_id()
        path = out / name
        n = 1
        while path.exists() and any(path.iterdir()) and not cfg.run_name:
            path = out / f"{name}-{n}"
            n += 1
        path.mkdir(parents=True, exist_ok=True)
        run = RunDir(path)
    elif resume:
        run = _resumable(RunDir(_resumed_folder(out, resume)), cfg)
        run.check_no_links()
    elif cfg.run_name and (out / cfg.run_name).is_dir():
        run = _resumable(RunDir(_resumed_folder(out, cfg.run_name)), cfg)
        run.check_no_links()
    else:
        runs = [RunDir(p) for p in sorted(out.iterdir()) if _in_root(out, p)] if out.is_dir() else []
        runs = [r for r in runs if r.latest_checkpoint() and not _nothing_left(r, cfg)]
        if not runs:
            raise ConfigError(f"--resume: no unfinished run with a checkpoint under {out}; start a new run without "
                              "--resume")
        run = max(runs, key=lambda r: r.path.stat().st_mtime)
        run.check_no_links()
    run.claim_format()
    return run
