"""``python -m pipetrain launch``: prepare a multi-node run's shared folder and start its launcher(s)."""
from __future__ import annotations

import sys

from ..process.cluster import launch_environment, node_commands, prepare_run_folder
from ..config import load_run_config, replace, save_toml
from ..process.deepspeed_cli import outcome, run_runner
from ..errors import ConfigError
from ..preflight import load_run
from ..run.folder import RunDir, new_run_id


def launch_cluster(config: str, node_rank: int | None, print_only: bool, resume: bool) -> int:
    cfg = load_run(config)
    if cfg.cluster is None:
        raise ConfigError("launch needs a [cluster] table; on one machine run "
                          "`deepspeed --num_gpus N --module pipetrain train CONFIG`", file=cfg.file, key="cluster")
    if cfg.run_name is None:
        cfg = replace(cfg, run_name=new_run_id())
    run = RunDir(cfg.resolve(cfg.output_dir) / cfg.run_name)
    run_dir, run_toml = run.path, run.run_toml
    if not run_toml.exists():
        run_dir.mkdir(parents=True, exist_ok=True)
        save_toml(cfg.with_absolute_paths(), run_toml)
    cfg = load_run_config(run_toml)
    hostfile = prepare_run_folder(cfg, run_dir)
    extra = ["--resume", cfg.run_name] if resume else []
    commands = node_commands(cfg, run_toml, hostfile, extra)
    if print_only or (len(commands) > 1 and node_rank is None):
        print(f"# run folder (must be shared by every node): {run_dir}")
        for c in commands:
            where = f"on {c.host}" + (f" (node rank {c.node_rank})" if c.node_rank is not None else "")
            print(f"# {where}, from {run_dir}:\n{c.shell()}")
        return 0 if print_only else 2
    command = commands[0] if node_rank is None else _node(commands, node_rank)
    print(f"[pipetrain] {command.shell()}", file=sys.stderr, flush=True)
    before = _identity(run.status_file)
    code = run_runner(command.argv, run_dir, launch_environment(cfg))   # here: torch is imported already
    if command.node_rank not in (None, 0):   # global rank 0, which writes the status, runs on node 0
        return code
    # DeepSpeed's runner exits 0 when its launch.py is killed: the run's status says whether it finished
    # (``deepspeed_cli.outcome``); a status the run did not rewrite is the previous launch's, not this one's
    status, why = outcome(str(run_dir) if _identity(run.status_file) != before else None, code)
    if why is not None:
        print(f"pipetrain: {why}", file=sys.stderr, flush=True)
    return status


def _identity(path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def _node(commands, node_rank: int):
    for c in commands:
        if c.node_rank == node_rank:
            return c
    raise ConfigError(f"--node-rank {node_rank}: the hostfile has nodes 0..{len(commands) - 1}")
