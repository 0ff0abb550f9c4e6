# SPDX-License-Identifier: GPL-3.0-or-later
"""The launcher starting multi-node runs (``[cluster]``) through ``backend/process/cluster.py``, with real processes.

Fast: what a no_ssh or pdsh start records and spawns, its resume, and which GPUs it holds on this machine.
Slow: a no_ssh run of two "nodes" against 127.0.0.1, node 0 started by the launcher and node 1 by the test
with the command the launcher recorded; the micro Flux trains 2 epochs in 2 pipeline stages, one per node.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from pipetrain.backend.process.command_lines import free_port
from pipetrain.launcher.core import Launcher, LauncherError
from pipetrain.backend.config.patch import RunPatch
from pipetrain.launcher.forms import adapter_patch, folder_patch, memory_patch, model_patch
from pipetrain.launcher.specs import ClusterSpec, DatasetSpec, ParallelismSpec, TrainSpec

pytestmark = pytest.mark.deepspeed_launcher   # tests/warm_ranks.py: why a real launch

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.fixture
def launcher(tmp_path):
    made = []

    def make(**kw):
        la = Launcher(tmp_path / "runs", **kw)
        made.append(la)
        return la

    yield make
    for la in made:  # never leave a child behind
        for ref in list(la.procs.values()):
            ref.signal_group(signal.SIGKILL)


def no_ssh(port: int | None = None) -> ClusterSpec:
    return ClusterSpec("no_ssh", ("node-a:1", "node-b:1"), master_addr="127.0.0.1", master_port=port or free_port(),
                       env=(("NCCL_PIPETRAIN_TEST_ENV", "forwarded"),))


def fake_spec(tmp_path, cluster: ClusterSpec) -> TrainSpec:
    """Files that pass the checks but cannot train: the run is killed at once."""
    (tmp_path / "images").mkdir(exist_ok=True)
    (tmp_path / "images" / "a.png").write_bytes(b"x")
    for name in ("dm", "vae", "te"):
        (tmp_path / f"{name}.safetensors").write_bytes(b"x")
    return TrainSpec(DatasetSpec((folder_patch(str(tmp_path / "images")),)),
                     model_patch("flux", str(tmp_path / "dm.safetensors"), str(tmp_path / "vae.safetensors"),
                                 (str(tmp_path / "te.safetensors"),)),
                     parallelism=ParallelismSpec(cluster=cluster, run=RunPatch.of({"pipeline_stages": 2})))


def test_no_ssh_start_runs_node_0_here_and_records_the_other_nodes_commands(tmp_path, launcher):
    la = launcher(lora_root=tmp_path / "loras")
    run_id = la.start(fake_spec(tmp_path, no_ssh(29517)), "multi")
    run_dir = la.dirs.path(run_id)
    info = json.loads((run_dir / "launcher.json").read_text())
    where = la.where(run_id)
    la.kill(run_id)
    argv = info["command"]
    assert argv[:4] == [sys.executable, "-u", "-m", "deepspeed.launcher.runner"] and "--num_gpus" not in argv
    assert ["--no_ssh", "--node_rank", "0"] == argv[argv.index("--no_ssh"):argv.index("--no_ssh") + 3]
    assert argv[argv.index("--hostfile") + 1] == str(run_dir / "hostfile")
    assert argv[argv.index("--master_addr") + 1] == "127.0.0.1" and argv[argv.index("--master_port") + 1] == "29517"
    assert (run_dir / "hostfile").read_text() == "node-a slots=1\nnode-b slots=1\n"
    assert "NCCL_PIPETRAIN_TEST_ENV=forwarded" in (run_dir / ".deepspeed_env").read_text()
    assert info["gpus"] == [0] and info["cluster"]["hosts"] == ["node-a:1", "node-b:1"]
    [node1] = info["node_commands"]
    assert node1["node_rank"] == 1 and node1["host"] == "node-b" and "--node_rank 1" in node1["deepspeed"]
    words = shlex.split(node1["command"])
    assert words[0] == "env" and words[1].startswith("PYTHONPATH=")
    assert words[words.index("launch"):] == ["launch", str(run_dir / "run.toml"), "--node-rank", "1"]
    # the Train node's text, the log and the run's route all carry the command
    assert "on 2 nodes (no_ssh: node-a:1, node-b:1)" in where and node1["command"] in where
    assert node1["command"] in (run_dir / "log.txt").read_text()
    run = la.get(run_id)
    assert run["node_commands"] == info["node_commands"] and run["cluster"]["launcher"] == "no_ssh"

    # resume: node 0 again with --resume, and the other nodes' commands again, with --resume
    # named as the trainer names checkpoints (``latest`` naming anything else is not followed)
    (run_dir / "checkpoints" / "step00000001").mkdir(parents=True)
    (run_dir / "checkpoints" / "step00000001" / "pipetrain.json").write_text("{}")   # what marks it complete
    (run_dir / "checkpoints" / "latest").write_text("step00000001")
    la.resume(run_id)
    info = json.loads((run_dir / "launcher.json").read_text())
    la.kill(run_id)
    assert info["command"][-2:] == ["--resume", run_id] and info["launches"] == 2
    assert info["node_commands"][0]["command"].endswith("--node-rank 1 --resume")


def test_only_this_machines_slots_are_held(tmp_path, launcher):
    la = launcher()
    run_id = la.start(fake_spec(tmp_path, no_ssh()), "held")
    try:
        with pytest.raises(LauncherError, match=f"in use by run {run_id}"):
            la.launch("single", SLEEPER, (0,))           # node 0's slot on this machine
        la.launch("single", SLEEPER, (1,))               # node-b's slot is on another machine
    finally:
        la.kill(run_id)
        la.kill("single")
    # pdsh to hosts that are not this machine: one command for every node, nothing held here
    pdsh = ClusterSpec("pdsh", ("gpu-node-1:2", "gpu-node-2:2"), master_port=free_port())
    run_id = la.start(fake_spec(tmp_path, pdsh), "pdsh")
    info = json.loads((la.dirs.path(run_id) / "launcher.json").read_text())
    if la.alive(run_id):
        la.kill(run_id)
    assert info["gpus"] == [] and info["node_commands"] == []
    assert info["command"][info["command"].index("--launcher") + 1] == "pdsh"
    assert la.where(run_id) == "on 2 nodes (pdsh: gpu-node-1:2, gpu-node-2:2)"


def _join(node: dict, cwd) -> str:
    """Run another node's recorded command to its end; returns its output (asserting exit code 0)."""
    other = subprocess.Popen(shlex.split(node["command"]), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
    try:
        out = other.communicate(timeout=900)[0]
    except subprocess.TimeoutExpired:
        os.killpg(other.pid, signal.SIGKILL)
        out = other.communicate()[0]
    (cwd / f"node{node['node_rank']}-{time.time():.0f}.log").write_text(out)
    assert other.returncode == 0, out[-3000:]
    return out


@pytest.mark.slow
def test_no_ssh_run_across_two_nodes_through_the_launcher(tmp_path, launcher, micro_flux_files):
    """Node 0 from the launcher, node 1 from its recorded command; stopped after its first step through the
    launcher, resumed through the launcher (node 1 with the command recorded again), finished: 2 epochs."""
    from concurrent.futures import ThreadPoolExecutor

    from pipetrain.backend.commands.demo import make_dataset

    make_dataset(tmp_path / "dataset", 4)
    files = micro_flux_files
    spec = TrainSpec(
        DatasetSpec((folder_patch(str(tmp_path / "dataset"), resolutions=(64,)),),
                    RunPatch.of({"resolutions": (64,), "enable_ar_bucket": True, "num_ar_buckets": 3})),
        model_patch("flux", str(files.diffusion_model), str(files.vae), tuple(str(p) for p in files.text_encoders),
                    dtype="float32"),
        adapter_patch(dict(rank=4, alpha=4.0)),
        RunPatch.of({"lr": 2e-3, "betas": (0.9, 0.99), "weight_decay": 0.01, "eps": 1e-8}, "optimizer"),
        RunPatch.of({"epochs": 2, "checkpoint_every_n_epochs": 1, "seed": 7}),
        ParallelismSpec(cluster=no_ssh(), run=RunPatch.of({"pipeline_stages": 2})), memory_patch(False))
    la = launcher(lora_root=tmp_path / "loras", stop_timeout=300)
    started = time.monotonic()
    run_id = la.start(spec, "twonodes")
    log = la.dirs.path(run_id) / "log.txt"
    [node1] = la.get(run_id)["node_commands"]
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(_join, node1, tmp_path)
        end = time.monotonic() + 600
        while la.alive(run_id) and not (la.get(run_id)["step"] or 0) >= 1:   # status from global rank 0
            assert time.monotonic() < end, log.read_text()[-3000:]
            time.sleep(0.1)
        la.stop(run_id)                                 # the stop file: rank 0 tells node 1's rank
        joined.result()
    assert la.wait(run_id, 120), log.read_text()[-3000:]
    run = la.get(run_id)
    assert run["state"] == "stopped" and run["resumable"] and run["step"] < 8, (run, log.read_text()[-3000:])
    stopped_at = run["step"]

    la.resume(run_id)
    [node1] = la.get(run_id)["node_commands"]
    assert node1["command"].endswith("--node-rank 1 --resume")
    _join(node1, tmp_path)
    assert la.wait(run_id, 120), log.read_text()[-3000:]
    run = la.get(run_id)
    print(f"\n2 nodes x 1 slot, 2 stages, 2 epochs, stopped at step {stopped_at} and resumed: "
          f"{time.monotonic() - started:.1f} s")
    assert run["state"] == "finished" and not run["alive"], (run, log.read_text()[-3000:])
    assert run["step"] == run["total_steps"] == 8 and run["epoch"] == 2
    assert [x["epoch"] for x in run["loras"]] == [1, 2]
    assert all(os.path.isfile(x["path"]) and x["path"].startswith(str(tmp_path / "loras" / run_id))
               for x in run["loras"])
    events = run["events"]
    assert [e for e in events if e["type"] == "start"][0]["world_size"] == 2
    assert [e for e in events if e["type"] == "resume"][-1]["step"] == stopped_at
    assert "NCCL_PIPETRAIN_TEST_ENV=forwarded" in (la.dirs.path(run_id) / ".deepspeed_env").read_text()
