# SPDX-License-Identifier: GPL-3.0-or-later
"""The Parallelism node's cluster section without a server: parsing, the node's errors, the spec it builds
and the ``[cluster]`` table the launcher writes from it (loaded back by the backend)."""
from __future__ import annotations

import pytest

from pipetrain.backend.host.runtime import ensure_comfyui
from pipetrain.launcher.cluster_form import cluster_form, cluster_table, local_devices, parse_env, parse_hosts
from pipetrain.launcher.specs import ClusterSpec

NO_SSH = {"cluster": "no_ssh", "hosts": "node-a:1, node-b:1", "master_addr": "127.0.0.1"}


@pytest.fixture(scope="module")
def node():
    ensure_comfyui()
    from pipetrain.nodes.parallelism import ParallelismNode
    return ParallelismNode


def check(node, **inputs):
    return node.validate_inputs(**{"gpus": 1, "pipeline_stages": 2, "gpu_ids": "", **inputs})


def test_parsers():
    assert parse_hosts("node-a:8, node-b:8\nnode-c:4") == ("node-a:8", "node-b:8", "node-c:4")
    assert parse_env("GLOO_SOCKET_IFNAME=eth0\n# a comment\n\nNCCL_DEBUG = INFO") == (
        ("GLOO_SOCKET_IFNAME", "eth0"), ("NCCL_DEBUG", "INFO"))
    for bad in ("no equals sign", "1X=2", "A B=1"):
        with pytest.raises(ValueError, match="KEY=VALUE"):
            parse_env(bad)
    assert cluster_form("off") is None and cluster_form(None) is None


def test_cluster_errors_are_named_on_the_node(node, tmp_path):
    assert check(node, **NO_SSH) is True                        # 2 slots for 2 stages, although gpus=1
    assert check(node, gpus=3) == ("pipeline_stages=2 does not divide gpus=3; use a GPU count that is a "
                                   "multiple of 2")           # one machine: unchanged
    assert "needs master_addr" in check(node, **{**NO_SSH, "master_addr": ""})
    assert "does not divide the 3 slots of the hosts (a:2, b:1)" in check(node, cluster="pdsh", hosts="a:2, b:1")
    assert "needs its hosts" in check(node, cluster="pdsh")
    assert "expected 'host:slots'" in check(node, cluster="pdsh", hosts="node-a")
    assert "exactly one of hostfile or hosts" in check(node, cluster="pdsh", hosts="a:2", hostfile=str(tmp_path))
    assert f"{tmp_path / 'missing'}: not found" in check(node, cluster="pdsh", hostfile=str(tmp_path / "missing"))
    assert "not a regular file" in check(node, cluster="pdsh", hostfile=str(tmp_path))
    bad = tmp_path / "bad_hostfile"
    bad.write_text("node-a slots=2\nnode-b 2\n")
    assert f"{bad}: line 2 is not '<host> slots=<n>'" in check(node, cluster="pdsh", hostfile=str(bad))
    assert "KEY=VALUE" in check(node, **NO_SSH, env="oops")
    assert "master_port 0" in check(node, **NO_SSH, master_port=0)   # ComfyUI skips min/max for checked inputs
    assert "apply to one machine" in check(node, **NO_SSH, gpu_ids="0")
    assert "choose one of" in check(node, **{**NO_SSH, "cluster": "mpich"})


def test_the_node_builds_a_cluster_spec_from_a_hostfile(node, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two machines\nnode-a slots=2\nnode-b slots=2  # the second\n")
    out = node.execute(gpus=1, pipeline_stages=2, micro_batch_size_per_gpu=1, gradient_accumulation_steps=1,
                       gpu_ids="", cluster="pdsh", hostfile=str(hostfile), master_port=29600,
                       env="GLOO_SOCKET_IFNAME=eth0", nccl_socket_ifname="eth0", nccl_ib_disable="true",
                       nccl_p2p_disable="default")
    spec = out.result[0]
    assert spec.cluster == ClusterSpec("pdsh", (), str(hostfile), "", 29600, (("GLOO_SOCKET_IFNAME", "eth0"),), "eth0",
                                       True, None)
    hash(spec)
    # run.toml gets the hostfile's hosts, so that the run folder is all another node needs
    assert cluster_table(spec.cluster) == {"launcher": "pdsh", "hosts": ["node-a:2", "node-b:2"], "master_port": 29600,
                                           "env": {"GLOO_SOCKET_IFNAME": "eth0"}, "nccl_socket_ifname": "eth0",
                                           "nccl_ib_disable": True}
    single = node.execute(gpus=2, pipeline_stages=2, micro_batch_size_per_gpu=1, gradient_accumulation_steps=1,
                          gpu_ids="")            # an older graph without the cluster widgets
    assert single.result[0].cluster is None and single.result[0].devices == (0, 1)
    inputs = node.define_schema().inputs
    assert {i.id: i.default for i in inputs}["cluster"] == "off"


def test_only_this_machines_slots_are_held():
    assert local_devices("no_ssh", [("node-a", 2), ("node-b", 4)]) == (0, 1)     # node 0 starts here
    assert local_devices("pdsh", [("node-a", 2), ("localhost", 3)]) == (0, 1, 2)
    assert local_devices("slurm", [("node-a", 2), ("node-b", 2)]) == ()


def test_the_launcher_writes_a_cluster_run_config_the_backend_loads(tmp_path):
    from pipetrain.backend.process.cluster import node_environment, read_hosts
    from pipetrain.backend.config import load_run_config
    from pipetrain.launcher.build import write_config
    from pipetrain.backend.config.patch import RunPatch
    from pipetrain.launcher.forms import folder_patch, model_patch
    from pipetrain.launcher.specs import DatasetSpec, ParallelismSpec, TrainSpec

    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.png").write_bytes(b"x")
    for name in ("dm", "vae", "te"):
        (tmp_path / f"{name}.safetensors").write_bytes(b"x")
    cluster = cluster_form("no_ssh", hosts="node-a:2 node-b:2", master_addr="10.0.0.1", env="NCCL_DEBUG=WARN",
                           nccl_p2p_disable="false")
    spec = TrainSpec(DatasetSpec((folder_patch(str(tmp_path / "images")),)),
                     model_patch("flux", str(tmp_path / "dm.safetensors"), str(tmp_path / "vae.safetensors"),
                                 (str(tmp_path / "te.safetensors"),)),
                     parallelism=ParallelismSpec(cluster=cluster, run=RunPatch.of({"pipeline_stages": 4})))
    cfg = load_run_config(write_config(spec, tmp_path / "run", output_dir=tmp_path, run_name="r", lora_dir=None))
    assert read_hosts(cfg) == [("node-a", 2), ("node-b", 2)] and cfg.cluster.master_addr == "10.0.0.1"
    assert node_environment(cfg) == {"NCCL_DEBUG": "WARN", "NCCL_P2P_DISABLE": "0"}
