"""Multi-node runs on DeepSpeed's own launcher: hostfiles, the per-node commands where each node must be
started by hand (``no_ssh``), the environment forwarded to every node, and NCCL options."""
from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from .config import RunConfig
from .errors import ConfigError
from .fsutil import atomic_write_bytes
from .launch import deepspeed_command


@dataclass
class NodeCommand:
    node_rank: int | None      # None: one command starts every node (pdsh, slurm, openmpi)
    host: str
    argv: list[str]

    def shell(self) -> str:
        return shlex.join(self.argv)


def read_hosts(cfg: RunConfig) -> list[tuple[str, int]]:
    c = cfg.cluster
    if c.hosts is not None:
        return [(h.partition(":")[0], int(h.partition(":")[2])) for h in c.hosts]
    path = cfg.resolve(c.hostfile)
    hosts = []
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise ConfigError(f"hostfile not found: {path}", file=cfg._file, key="cluster.hostfile") from None
    for n, line in enumerate(lines, 1):
        line = line.split("#")[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].startswith("slots=") or not parts[1][6:].isdigit():
            raise ConfigError(f"{path}:{n}: expected '<host> slots=<n>', got {line!r}", file=cfg._file,
                              key="cluster.hostfile")
        hosts.append((parts[0], int(parts[1][6:])))
    if not hosts:
        raise ConfigError(f"{path} names no host", file=cfg._file, key="cluster.hostfile")
    return hosts


def world_size(cfg: RunConfig) -> int:
    return sum(slots for _, slots in read_hosts(cfg))


def node_environment(cfg: RunConfig) -> dict[str, str]:
    c = cfg.cluster
    env = {k: str(v) for k, v in c.env.items()}
    if c.nccl_socket_ifname:
        env["NCCL_SOCKET_IFNAME"] = c.nccl_socket_ifname
    if c.nccl_ib_disable is not None:
        env["NCCL_IB_DISABLE"] = "1" if c.nccl_ib_disable else "0"
    if c.nccl_p2p_disable is not None:
        env["NCCL_P2P_DISABLE"] = "1" if c.nccl_p2p_disable else "0"
    return env


def prepare_run_folder(cfg: RunConfig, run_dir: Path) -> Path:
    """Write the hostfile and ``.deepspeed_env`` into the shared run directory; returns the hostfile."""
    run_dir.mkdir(parents=True, exist_ok=True)
    hosts = read_hosts(cfg)
    hostfile = run_dir / "hostfile"
    atomic_write_bytes(hostfile, "".join(f"{h} slots={s}\n" for h, s in hosts).encode())
    env = node_environment(cfg)
    atomic_write_bytes(run_dir / ".deepspeed_env", "".join(f"{k}={v}\n" for k, v in env.items()).encode())
    return hostfile


def node_commands(cfg: RunConfig, run_toml: Path, hostfile: Path, extra: list[str] = ()) -> list[NodeCommand]:
    """The launcher command(s): one for pdsh/slurm/openmpi (DeepSpeed reaches every node itself), one per
    node for ``no_ssh`` (each node starts its own launcher with its node rank)."""
    c = cfg.cluster
    hosts = read_hosts(cfg)
    cfg.check_world_size(sum(s for _, s in hosts))
    common = ["--hostfile", str(hostfile)] + (["--master_addr", c.master_addr] if c.master_addr else [])

    def command(slots: int, launcher_args: list[str]) -> list[str]:
        argv = deepspeed_command("train", run_toml, slots, list(extra), master_port=c.master_port,
                                 launcher_args=common + launcher_args)
        return _without_num_gpus(argv)

    if c.launcher != "no_ssh":
        return [NodeCommand(None, hosts[0][0], command(hosts[0][1], ["--launcher", c.launcher]))]
    return [NodeCommand(rank, host, command(slots, ["--no_ssh", "--node_rank", str(rank)]))
            for rank, (host, slots) in enumerate(hosts)]


def _without_num_gpus(argv: list[str]) -> list[str]:
    """With a hostfile the slots say how many ranks each node starts."""
    i = argv.index("--num_gpus")
    return argv[:i] + argv[i + 2:]


def launch_environment(cfg: RunConfig) -> dict[str, str]:
    return {**os.environ, **node_environment(cfg)}
