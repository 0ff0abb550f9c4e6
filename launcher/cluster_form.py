# SPDX-License-Identifier: GPL-3.0-or-later
"""Multi-node runs from the graph: the Parallelism node's cluster form -> ``ClusterSpec`` -> the ``[cluster]``
table of ``run.toml``, checked by the backend's own rules (``backend.config.ClusterConfig``,
``backend.process.cluster.read_hosts``) before anything starts; and the commands a ``no_ssh`` run's other nodes run.

The run folder is self-contained: a hostfile is read when the run starts and its hosts are written into
``run.toml``, so every node needs only the shared run folder (``python -m pipetrain launch <run>/run.toml``).
"""
from __future__ import annotations

import re
import shlex
import socket
from pathlib import Path

from ..backend.process.cluster import read_hosts
from ..backend.config import ClusterConfig, RunConfig
from ..backend.errors import ConfigError
from ..backend.config.schema import from_dict
from .procs import python_argv
from .specs import ClusterSpec

OFF = "off"                                   # the Parallelism node's "one machine" choice
LAUNCHERS = ("pdsh", "no_ssh", "slurm", "openmpi")
FLAGS = {"default": None, "true": True, "false": False}
WHERE = "the Parallelism node"
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_hosts(text: str) -> tuple[str, ...]:
    """``node-a:8, node-b:8`` (commas, spaces or lines) -> ("node-a:8", "node-b:8"); checked by the backend."""
    return tuple(w for w in re.split(r"[\s,;]+", text or "") if w)


def parse_env(text: str) -> tuple[tuple[str, str], ...]:
    """``KEY=VALUE`` a line (``#`` comments) -> sorted pairs."""
    pairs = {}
    for n, line in enumerate((text or "").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, eq, value = line.partition("=")
        key = key.strip()
        if not eq or not ENV_NAME.match(key):
            raise ValueError(f"env line {n} {line!r}: write one KEY=VALUE a line, e.g. NCCL_DEBUG=WARN")
        pairs[key] = value.strip()
    return tuple(sorted(pairs.items()))


def cluster_form(cluster: str | None, *, hostfile: str = "", hosts: str = "", master_addr: str = "",
                 master_port: int = 29500, env: str = "", nccl_socket_ifname: str = "",
                 nccl_ib_disable: str = "default", nccl_p2p_disable: str = "default") -> ClusterSpec | None:
    """The node's widgets -> a ``ClusterSpec`` (``None``: one machine). ``hostfile`` is already an absolute
    path (or empty). Raises ``ValueError``/``ConfigError`` naming the widget."""
    if cluster in (None, OFF):
        return None
    if cluster not in LAUNCHERS:
        raise ValueError(f"cluster {cluster!r}: choose one of {', '.join((OFF,) + LAUNCHERS)}")
    if not 1 <= int(master_port) <= 65535:
        raise ValueError(f"master_port {master_port}: a TCP port, 1 to 65535")
    for name, value in (("nccl_ib_disable", nccl_ib_disable), ("nccl_p2p_disable", nccl_p2p_disable)):
        if value not in FLAGS:
            raise ValueError(f"{name} {value!r}: choose one of {', '.join(FLAGS)}")
    spec = ClusterSpec(cluster, parse_hosts(hosts), (hostfile or "").strip(), (master_addr or "").strip(),
                       int(master_port), parse_env(env), (nccl_socket_ifname or "").strip(),
                       FLAGS[nccl_ib_disable], FLAGS[nccl_p2p_disable])
    if not spec.hosts and not spec.hostfile:
        raise ConfigError(f"cluster {cluster!r} needs its hosts, e.g. node-a:8, node-b:8 (node 0 first), or a "
                          "hostfile", file=WHERE, key="cluster.hosts")
    cluster_hosts(spec)   # the backend's rules, and the hostfile read, now
    return spec


def _table(spec: ClusterSpec, hosts: list[str] | None = None) -> dict:
    """The ``[cluster]`` table: with ``hosts`` given, those instead of the spec's host list or hostfile."""
    table = {"launcher": spec.launcher, "master_addr": spec.master_addr or None, "master_port": spec.master_port,
             "env": dict(spec.env) or None, "nccl_socket_ifname": spec.nccl_socket_ifname or None,
             "nccl_ib_disable": spec.nccl_ib_disable, "nccl_p2p_disable": spec.nccl_p2p_disable}
    if hosts is not None:
        table["hosts"] = hosts
    else:
        table.update(hosts=list(spec.hosts) or None, hostfile=spec.hostfile or None)
    return {k: v for k, v in table.items() if v is not None}


def _config(table: dict) -> ClusterConfig:
    return from_dict(ClusterConfig, table, file=WHERE, prefix="cluster")   # the backend's validation


def cluster_hosts(spec: ClusterSpec) -> list[tuple[str, int]]:
    """(host, slots) per node, from the host list or the hostfile, by the backend's reader."""
    # ``read_hosts`` reads only a config's cluster table (and resolves the hostfile, already absolute)
    carrier = RunConfig(output_dir="", dataset="", model=None, cluster=_config(_table(spec)))
    try:
        return read_hosts(carrier)
    except ConfigError as e:   # the hostfile's refusals, named on the node like the others
        if e.file is not None:
            raise
        raise ConfigError(str(e).removeprefix(f"key '{e.key}': "), file=WHERE, key=e.key) from None
    except OSError as e:   # a folder, no permission (a missing file is the backend's ConfigError)
        raise ConfigError(f"cannot read hostfile {spec.hostfile}: {e.strerror}", file=WHERE,
                          key="cluster.hostfile") from None


def cluster_table(spec: ClusterSpec) -> dict:
    """``[cluster]`` for ``run.toml``: a hostfile's hosts written out, so the run folder is all a node needs."""
    table = _table(spec, [f"{h}:{s}" for h, s in cluster_hosts(spec)])
    _config(table)
    return table


def check_cluster(spec: ClusterSpec, pipeline_stages: int) -> int:
    """The total slots (world size); ``ConfigError`` when ``pipeline_stages`` does not divide it."""
    hosts = cluster_hosts(spec)
    world = sum(s for _, s in hosts)
    if world % pipeline_stages:
        listed = ", ".join(f"{h}:{s}" for h, s in hosts)
        raise ConfigError(f"pipeline_stages={pipeline_stages} does not divide the {world} slots of the hosts "
                          f"({listed}); give the hosts a total slot count that is a multiple of {pipeline_stages}",
                          file=WHERE, key="pipeline_stages")
    return world


def local_devices(launcher: str, hosts: list[tuple[str, int]]) -> tuple[int, ...]:
    """The GPUs this machine gives the run: node 0's slots for ``no_ssh`` (node 0 starts here); otherwise
    the slots of the host entry naming this machine, if any (DeepSpeed uses GPUs 0..slots-1 of each host)."""
    if launcher == "no_ssh":
        return tuple(range(hosts[0][1]))
    names = _this_machine()
    for host, slots in hosts:
        if host in names:
            return tuple(range(slots))
    return ()


def _this_machine() -> set[str]:
    import psutil

    name = socket.gethostname()
    names = {"localhost", "127.0.0.1", "::1", name, name.split(".")[0], socket.getfqdn()}
    for addrs in psutil.net_if_addrs().values():
        names.update(a.address.split("%")[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6))
    return names


def join_command(run_toml: Path, node_rank: int, resume: bool, env: dict[str, str]) -> str:
    """What another node runs to join (or resume) the run: ``python -m pipetrain launch`` on the shared run
    folder, which prepares the folder, sets the forwarded environment and starts that node's launcher."""
    argv = python_argv("launch", str(run_toml), "--node-rank", str(node_rank), *(["--resume"] if resume else []))
    prefix = ["env", *(f"{k}={v}" for k, v in env.items())] if env else []
    return shlex.join(prefix + argv)
