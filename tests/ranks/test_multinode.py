"""Two "nodes" on one machine: a hostfile naming two hosts with one slot each and two DeepSpeed launchers
started with --no_ssh --node_rank 0|1 against 127.0.0.1; the 2-stage pipeline has one stage per node."""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import Run

from pipetrain.backend.config import load_run_config
from pipetrain.backend.process.command_lines import free_port
from pipetrain.backend.parity.verify import check_lora

pytestmark = [pytest.mark.slow, pytest.mark.deepspeed_launcher]   # tests/warm_ranks.py: why a real launch


def _config(make_run, files, name, epochs):
    cluster = {"launcher": "no_ssh", "hosts": ["node-a:1", "node-b:1"], "master_addr": "127.0.0.1",
               "master_port": free_port(), "env": {"NCCL_PIPETRAIN_TEST_ENV": "forwarded"}}
    return make_run(files, images=4, name=name, stages=2, epochs=epochs, checkpoint_every_n_epochs=1,
                    run_name=name, cluster=cluster)


def _node(config, rank, *extra):
    cmd = [sys.executable, "-m", "pipetrain", "launch", str(config), "--node-rank", str(rank), *extra]
    return subprocess.Popen(cmd, cwd=config.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _both(config, *extra, timeout=900):
    nodes = [_node(config, 0, *extra), _node(config, 1, *extra)]
    outs = [p.communicate(timeout=timeout)[0] for p in nodes]
    return [p.returncode for p in nodes], outs


def _started(config, name, event):
    """Both nodes, once the run's events hold ``event``."""
    nodes = [_node(config, 0), _node(config, 1)]
    events = config.parent / "output" / name / "events.jsonl"
    end = time.monotonic() + 600
    while time.monotonic() < end and not (events.exists() and f'"{event}"' in events.read_text()):
        time.sleep(0.2)
    return nodes


def test_print_gives_one_command_per_node(micro_flux_files, make_run):
    config = _config(make_run, micro_flux_files, "printed", epochs=1)
    out = subprocess.run([sys.executable, "-m", "pipetrain", "launch", str(config), "--print"], capture_output=True,
                         text=True, check=True).stdout
    assert out.count("--no_ssh") == 2 and "--node_rank 0" in out and "--node_rank 1" in out
    run_dir = config.parent / "output" / "printed"
    assert (run_dir / "hostfile").read_text() == "node-a slots=1\nnode-b slots=1\n"
    assert "NCCL_PIPETRAIN_TEST_ENV=forwarded" in (run_dir / ".deepspeed_env").read_text()


@pytest.fixture(scope="module")
def lost_and_resumed(micro_flux_files, tmp_path_factory):
    """One 2-epoch run of two nodes: node 1 killed after epoch 1's checkpoint (node 0 fails), then both resumed to
    the end. Its failure is one test's, its resumed end the two-node training test's: that training on two nodes
    ends in a LoRA ComfyUI loads holds for a run resumed on them as for one started fresh, and a second pair of
    launches (each a runner, a launch.py and a rank importing torch) cost that test most of its time."""
    from pipetrain.backend.commands.demo import make_dataset

    root = tmp_path_factory.mktemp("multinode")

    def make_run(files, images, name, **overrides):
        from pipetrain.backend.commands.demo import write_configs

        make_dataset(root / name / "dataset", images)
        return write_configs(root / name, files, **overrides)

    config = _config(make_run, micro_flux_files, "lost", epochs=2)
    nodes = _started(config, "lost", "checkpoint")
    os.killpg(nodes[1].pid, signal.SIGKILL)
    out0 = nodes[0].communicate(timeout=300)[0]
    nodes[1].communicate()
    failed = Run(nodes[0].returncode, out0, config.parent / "output")
    failed_status, checkpoint_step = failed.status(), failed.events("checkpoint")[-1]["step"]
    codes, outs = _both(config.parent / "output" / "lost" / "run.toml", "--resume")
    return dict(config=config, failed=failed, failed_status=failed_status, checkpoint_step=checkpoint_step,
                codes=codes, outs=outs)


def test_two_nodes_train_and_lora_loads_in_comfyui(lost_and_resumed):
    config, codes, outs = lost_and_resumed["config"], lost_and_resumed["codes"], lost_and_resumed["outs"]
    assert codes == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    run = Run(0, outs[0], config.parent / "output")
    assert run.run_dir.name == "lost" and run.status()["state"] == "finished"
    assert [e["epoch"] for e in run.events("lora_saved")] == [1, 2]
    assert run.events("start")[0]["world_size"] == 2
    check = check_lora(load_run_config(config), run.loras()[-1])
    assert check.comfy_vs_training < 1e-4 * max(1.0, check.scale) and check.lora_effect > 1e-4


def test_losing_a_node_fails_clearly_and_resumes(lost_and_resumed):
    run, status = lost_and_resumed["failed"], lost_and_resumed["failed_status"]
    assert run.returncode != 0
    assert status["state"] == "failed"
    assert "lost contact with another rank" in status["error"] and "--resume lost" in status["error"]
    checkpoint_step = lost_and_resumed["checkpoint_step"]

    codes, outs = lost_and_resumed["codes"], lost_and_resumed["outs"]
    assert codes == [0, 0], outs[0][-3000:]
    assert run.events("resume")[-1]["step"] >= checkpoint_step
    assert run.status()["state"] == "finished" and run.status()["step"] == 8   # 2 epochs of 4 images, batch 1
    json.loads((run.run_dir / "status.json").read_text())


def test_a_killed_launcher_on_node_0_exits_non_zero(micro_flux_files, make_run):
    """DeepSpeed's runner exits 0 when its launch.py is killed; ``launch`` on node 0 exits by the run's status."""
    import psutil

    config = _config(make_run, micro_flux_files, "killed", epochs=40)
    nodes = _started(config, "killed", "step")
    (launch_py,) = [p for p in psutil.Process(nodes[0].pid).children(recursive=True)
                    if "deepspeed.launcher.launch" in " ".join(p.cmdline())]
    # DeepSpeed's runner runs in ``launch`` itself (which imported torch loading the config), no interpreter of its own
    assert launch_py.ppid() == nodes[0].pid
    launch_py.kill()
    out0 = nodes[0].communicate(timeout=300)[0]
    nodes[1].communicate(timeout=300)
    assert nodes[0].returncode != 0, out0[-3000:]
    assert f"pipetrain: the run in {config.parent / 'output' / 'killed'} did not finish" in out0


def test_a_signal_to_launch_stops_the_run_at_a_checkpoint_and_leaves_no_rank(micro_flux_files, make_run):
    """``launch`` runs DeepSpeed's runner in its own process: SIGTERM to it goes to the ranks (they checkpoint at the
    next step and stop, as under ``pipetrain deepspeed``), not to the runner, which would die of it and leave the
    ranks behind. One host of two slots: a single launch command, the cheapest real one."""
    import psutil

    from pipetrain.backend.process.deepspeed_cli import ranks_among

    cluster = {"launcher": "no_ssh", "hosts": ["localhost:2"], "master_addr": "127.0.0.1", "master_port": free_port()}
    config = make_run(micro_flux_files, images=4, name="signalled", stages=2, epochs=40, run_name="signalled",
                      checkpoint_every_n_epochs=1000, cluster=cluster)
    log = config.parent / "launch.log"
    with open(log, "w") as out:   # a file, not a pipe: the ranks hold its other end, and a pipe's reader waits for them
        proc = subprocess.Popen([sys.executable, "-m", "pipetrain", "launch", str(config)], cwd=config.parent,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    run_dir = config.parent / "output" / "signalled"
    try:
        end = time.monotonic() + 600
        while not ((run_dir / "events.jsonl").exists() and '"step"' in (run_dir / "events.jsonl").read_text()):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < end, "no step within 600 s"
            time.sleep(0.2)
        ranks = ranks_among(psutil.Process(proc.pid).children(recursive=True))
        assert len(ranks) == 2
        os.kill(proc.pid, signal.SIGTERM)   # the launch process alone, as a service manager stops it
        proc.wait(timeout=300)
        left = [p.pid for p in ranks if _alive(p)]   # as it ends: its runner waited for them
    finally:
        with contextlib.suppress(ProcessLookupError):   # whatever of its session outlived it
            os.killpg(proc.pid, signal.SIGKILL)
    out = log.read_text()
    assert left == [], f"ranks {left} outlived their launch: {out[-3000:]}"
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert f"pipetrain: the run in {run_dir} stopped on SIGTERM" in out, out[-3000:]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "stopped" and status["stop_signal"] == signal.SIGTERM, status
    assert (run_dir / "checkpoints" / f"step{status['step']:08d}" / "pipetrain.json").is_file()


def _alive(process) -> bool:
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
