"""Multi-node runs on DeepSpeed's own launcher: hostfiles, the per-node commands where each node must be
started by hand (``no_ssh``), the environment forwarded to every node, and NCCL options."""
from __future__ import annotations

import os
import re
import shlex
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

from ..config import RunConfig
from ..errors import ConfigError
from ..fsutil import atomic_write_bytes
from ..config.process_inputs import env_name_problem, env_value_problem, host_problem, plain_problem
from .command_lines import deepspeed_command


@dataclass
class NodeCommand:
    node_rank: int | None      # None: one command starts every node (pdsh, slurm, openmpi)
    host: str
    argv: list[str]

    def shell(self) -> str:
        return shlex.join(self.argv)


MAX_HOSTFILE = 64 * 1024     # a hostfile lists hosts; anything larger is not one


def read_hosts(cfg: RunConfig) -> list[tuple[str, int]]:
    """(host, slots) per node, from ``hosts`` or the hostfile. Each host passes the same rule as ``hosts``; a
    refusal names the file, the line and the problem, never the line itself (any readable file may be named
    here, and its content must not come back in a message)."""
    c = cfg.cluster
    if c.hosts is not None:
        return [(h.partition(":")[0], int(h.partition(":")[2])) for h in c.hosts]
    path = cfg.resolve(c.hostfile)
    key = "cluster.hostfile"

    def refuse(message: str):
        return ConfigError(f"hostfile {path}: {message}", file=cfg.file, key=key)

    try:
        if not stat.S_ISREG(path.stat().st_mode):      # a folder, a FIFO (would block), a device
            raise refuse("not a regular file")
        with open(path, "rb") as f:
            data = f.read(MAX_HOSTFILE + 1)
    except FileNotFoundError:
        raise refuse("not found") from None
    except OSError as e:        # no permission, a name too long, ...
        raise refuse(f"cannot be read ({e.strerror})") from None
    if len(data) > MAX_HOSTFILE:
        raise refuse(f"larger than {MAX_HOSTFILE // 1024} KiB; a hostfile lists '<host> slots=<n>' a line")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise refuse("not UTF-8 text; a hostfile lists '<host> slots=<n>' a line") from None
    hosts = []
    for n, line in enumerate(text.split("\n"), 1):
        line = line.split("#")[0].strip(" \t\r")
        if not line:
            continue
        parts = line.split(" ") if "\t" not in line else line.replace("\t", " ").split(" ")
        parts = [p for p in parts if p]
        if len(parts) != 2 or not re.fullmatch(r"slots=[0-9]{1,4}", parts[1]) or parts[1] == "slots=0":
            raise refuse(f"line {n} is not '<host> slots=<n>' (a host name, a space, slots= and a number of GPUs)")
        problem = host_problem(parts[0])
        if problem:
            raise refuse(f"the host on line {n} {problem}")
        hosts.append((parts[0], int(parts[1][6:])))
    if not hosts:
        raise refuse("names no host; write '<host> slots=<n>' a line")
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
    for k, v in env.items():     # the layer below the config's rules: one KEY=VALUE a line, nothing else
        if env_name_problem(k) or env_value_problem(v):
            raise ConfigError(f"{k}: {env_name_problem(k) or env_value_problem(v)}", file=cfg.file, key="cluster.env")
    atomic_write_bytes(run_dir / ".deepspeed_env", "".join(f"{k}={v}\n" for k, v in env.items()).encode())
    return hostfile


def node_commands(cfg: RunConfig, run_toml: Path, hostfile: Path, extra: list[str] = ()) -> list[NodeCommand]:
    """The launcher command(s): one for pdsh/slurm/openmpi (DeepSpeed reaches every node itself), one per
    node for ``no_ssh`` (each node starts its own launcher with its node rank)."""
    c = cfg.cluster
    hosts = read_hosts(cfg)
    cfg.check_world_size(sum(s for _, s in hosts))
    if c.launcher == "pdsh":
        _check_pdsh_words(cfg, [str(run_toml.parent), str(run_toml), sys.executable, *extra])
    common = ["--hostfile", str(hostfile)] + (["--master_addr", c.master_addr] if c.master_addr else [])

    def command(slots: int, launcher_args: list[str]) -> list[str]:
        argv = deepspeed_command("train", run_toml, slots, list(extra), master_port=c.master_port,
                                 launcher_args=common + launcher_args)
        return _without_num_gpus(argv)

    if c.launcher != "no_ssh":
        return [NodeCommand(None, hosts[0][0], command(hosts[0][1], ["--launcher", c.launcher]))]
    return [NodeCommand(rank, host, command(slots, ["--no_ssh", "--node_rank", str(rank)]))
            for rank, (host, slots) in enumerate(hosts)]


def _check_pdsh_words(cfg: RunConfig, words: list[str]) -> None:
    """DeepSpeed's pdsh runner puts ``cd <run dir>;``, the interpreter and the module's arguments into the remote
    shell's command line unquoted (or in double quotes where they hold a space): each must be plain."""
    for word in words:
        problem = plain_problem(word)
        if problem:
            raise ConfigError(f"{word!r} {problem}; with launcher = 'pdsh' the run folder (output_dir) and Python "
                              "must sit at such paths", file=cfg.file, key="cluster.launcher")


def _without_num_gpus(argv: list[str]) -> list[str]:
    """With a hostfile the slots say how many ranks each node starts."""
    i = argv.index("--num_gpus")
    return argv[:i] + argv[i + 2:]


def launch_environment(cfg: RunConfig) -> dict[str, str]:
    return {**os.environ, **node_environment(cfg)}
