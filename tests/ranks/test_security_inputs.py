# SPDX-License-Identifier: GPL-3.0-or-later
"""The rules for values that reach other processes (``backend/config/process_inputs.py`` through ``ClusterConfig`` and
the hostfile reader), payload family by payload family; and the layer below them: what ``.deepspeed_env``, the
hostfile and the launcher command we write become in DeepSpeed's own pdsh runner, run by a real bash.

No server here (``test_security_server.py`` drives the same payloads through ComfyUI): seconds.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipetrain.backend.process.cluster import node_commands, prepare_run_folder, read_hosts
from pipetrain.backend.config import ClusterConfig, RunConfig, load_run_config, save_toml
from pipetrain.backend.errors import ConfigError
from pipetrain.backend.config.process_inputs import env_name_problem, env_value_problem, host_problem, ifname_problem
from pipetrain.backend.config.schema import from_dict

MARKER = "pipetrain-security-marker"
BASE = {"launcher": "pdsh", "hosts": ["node-a:1", "node-b:1"], "master_addr": "10.0.0.1"}


def cluster(**changes) -> ClusterConfig:
    return from_dict(ClusterConfig, {**BASE, **changes}, file="test.toml", prefix="cluster")


def refused(key: str, **changes) -> str:
    with pytest.raises(ConfigError) as e:
        cluster(**changes)
    assert e.value.key == key or e.value.key.startswith(key), (e.value.key, str(e.value))
    assert f"key '{e.value.key}'" in str(e.value)
    return str(e.value)


HOST_PAYLOADS = ["-oProxyCommand=touch${IFS}marker", "-oProxyCommand=touch marker", "node-a;touch marker",
                 "$(touch marker)", "`touch marker`", "node a", "node-a\nnode-b", "node\x00a", "user@node-a",
                 "node[1-4]", "^hostfile", "node-a'", 'node-a"', "node-a\\", "node-a|id", "node-a&", "node-a>x",
                 "-", "", "a" * 300, "node-\u2028a", "nodé", "::1", "node-a.", ".node-a", "1.2.3.999", "1.2.3"]


@pytest.mark.parametrize("host", HOST_PAYLOADS)
def test_hosts_and_master_addr_are_host_names_or_ipv4_only(host):
    assert host_problem(host), host
    refused("cluster.hosts", hosts=[f"{host}:1"])
    refused("cluster.master_addr", master_addr=host or "-")


def test_good_hosts_pass():
    for host in ("node-a", "node_7", "gpu01.cluster.example.org", "10.0.0.1", "localhost", "255.255.255.255"):
        assert host_problem(host) is None, host
    assert cluster(hosts=["gpu01.example.org:8", "10.0.0.2:8"], master_addr="10.0.0.1").master_addr == "10.0.0.1"


def test_the_refusal_names_the_field_and_the_problem():
    message = refused("cluster.master_addr", master_addr="10.0.0.1;touch marker;#")
    assert "key 'cluster.master_addr'" in message and "is not a host name or IPv4 address" in message
    assert "starts with '-', which ssh and pdsh read as an option" in refused(
        "cluster.hosts", hosts=["-oProxyCommand=touch${IFS}marker:1"])
    assert "U+000A" in refused("cluster.nccl_socket_ifname", nccl_socket_ifname="eth0\nLD_PRELOAD=/tmp/x.so")


@pytest.mark.parametrize("name", [
    "PYTHONPATH", "PYTHONSTARTUP", "PYTHONHOME", "PYTHONBREAKPOINT", "PYTHONUSERBASE", "LD_PRELOAD",
    "LD_LIBRARY_PATH", "LD_AUDIT", "DYLD_INSERT_LIBRARIES", "PATH", "BASH_ENV", "ENV", "IFS", "SHELLOPTS", "PS4",
    "PROMPT_COMMAND", "HOME", "TMPDIR", "SSH_ASKPASS", "PDSH_SSH_ARGS_APPEND", "PDSH_RCMD_TYPE", "DS_ENV_FILE",
    "GCONV_PATH", "NODE_OPTIONS", "PERL5OPT", "CC", "CXX", "HF_HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
    "NCCL_NET_PLUGIN", "NCCL_TUNER_PLUGIN", "NCCL_DEBUG_FILE", "NCCL_CONF_FILE", "NCCL_TOPO_DUMP_FILE",
    "CUDA_INJECTION64_PATH", "CUDA_HOME", "CUDA_CACHE_PATH", "UCX_MODULE_DIR", "FI_PROVIDER_PATH",
    "OMP_TOOL_LIBRARIES", "TORCH_EXTENSIONS_DIR", "TORCH_HOME", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD",
    "PYTORCH_KERNEL_CACHE_PATH", "TORCH_LOGS_OUT", "TORCH_TRACE", "CUDA_MPS_LOG_DIRECTORY", "NCCL_LD_PRELOAD", "FOO_PRELOAD", "lower_case", "1X", "A-B", "A B", "", "A=B",
    "NCCL_DEBUG\n"])
def test_environment_names_outside_the_tuning_families_are_refused(name):
    assert env_name_problem(name), name
    refused("cluster.env", env={name: "1"})


def test_tuning_switches_pass():
    for name in ("NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "NCCL_P2P_DIRECT_DISABLE", "NCCL_IB_HCA", "GLOO_SOCKET_IFNAME",
                 "UCX_TLS", "FI_PROVIDER", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_DEVICE_MAX_CONNECTIONS",
                 "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_DISTRIBUTED_DEBUG", "PYTORCH_CUDA_ALLOC_CONF",
                 "TOKENIZERS_PARALLELISM"):
        assert env_name_problem(name) is None, name
    assert cluster(env={"NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": 8}).env["OMP_NUM_THREADS"] == 8


@pytest.mark.parametrize("value", ["$(touch marker)", "`touch marker`", "x\"; touch marker; \"", "x'", "a\\",
                                   "${IFS}", "1\nLD_PRELOAD=/tmp/evil.so", "1\rLD_PRELOAD=/tmp/evil.so", "a\x00b",
                                   "a\u2028LD_PRELOAD=x", "a\x85b", "a\x1bb", "eth0,LD_PRELOAD=/tmp/x.so", "%h",
                                   "x" * 5000])
def test_environment_values_that_a_shell_or_a_line_reader_would_act_on_are_refused(value):
    assert env_value_problem(value), value
    message = refused("cluster.env.NCCL_DEBUG", env={"NCCL_DEBUG": value})
    assert "touch marker" not in message     # the value is named by its key, not echoed


@pytest.mark.parametrize("value", ["eth0\nLD_PRELOAD=/x.so", "eth0;touch marker", "-eth0", "eth0 eth1", "$(x)",
                                   "eth0,,eth1", "", "eth0,LD_PRELOAD=x"])
def test_nccl_socket_ifname_is_a_plain_interface_list(value):
    assert ifname_problem(value), value
    refused("cluster.nccl_socket_ifname", nccl_socket_ifname=value)


def test_interface_lists_pass():
    for value in ("eth0", "^docker,lo", "=ib0", "eth0,eth1", "bond0.100", "enp1s0f0"):
        assert ifname_problem(value) is None, value


def carrier(tmp_path: Path, **changes) -> RunConfig:
    return RunConfig(output_dir=str(tmp_path), dataset="", model=None, cluster=cluster(**changes))


def test_a_hostfile_refusal_never_quotes_the_file(tmp_path):
    environ = Path("/proc/self/environ")
    os.environ["PIPETRAIN_SECRET_FOR_TEST"] = "s3cr3t-value-never-shown"
    hostile = tmp_path / "hostfile"
    hostile.write_text("node-a slots=1\n-oProxyCommand=touch${IFS}marker slots=1\n")
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe secret-bytes slots=1\n")
    big = tmp_path / "big"
    big.write_text("node-a slots=1\n" * 10000)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)     # reading it would block the server forever
    cases = [(Path("/etc/passwd"), "line 1 is not '<host> slots=<n>'"),
             (hostile, "the host on line 2 starts with '-'"), (binary, "not UTF-8 text"),
             (big, "larger than 64 KiB"), (fifo, "not a regular file"), (tmp_path, "not a regular file"),
             (tmp_path / "missing", "not found"), (tmp_path / ("x" * 300), "cannot be read (File name too long)")]
    if environ.exists():
        cases.append((environ, "line 1 is not '<host> slots=<n>'"))
    secrets = ["root:", "s3cr3t-value-never-shown", "PATH=", "oProxyCommand", "secret-bytes", "\\xff"]
    for path, problem in cases:
        with pytest.raises(ConfigError) as e:
            read_hosts(carrier(tmp_path, hosts=None, hostfile=str(path)))
        message = str(e.value)
        assert e.value.key == "cluster.hostfile" and problem in message and str(path) in message, message
        for secret in secrets:
            assert secret not in message.replace(str(path), ""), (secret, message)


def test_hostfile_lines_pass_the_host_rule_and_are_written_plain(tmp_path):
    good = tmp_path / "hosts"
    good.write_text("# nodes\nnode-a slots=2  # first\n\n10.0.0.2\tslots=2\n")
    cfg = carrier(tmp_path, hosts=None, hostfile=str(good), env={"NCCL_DEBUG": "INFO"},
                  nccl_socket_ifname="^docker,lo")
    assert read_hosts(cfg) == [("node-a", 2), ("10.0.0.2", 2)]
    written = prepare_run_folder(cfg, tmp_path / "run")
    assert written.read_text() == "node-a slots=2\n10.0.0.2 slots=2\n"
    assert (tmp_path / "run" / ".deepspeed_env").read_text() == "NCCL_DEBUG=INFO\nNCCL_SOCKET_IFNAME=^docker,lo\n"


def test_a_run_toml_edited_by_hand_is_checked_when_loaded(tmp_path):
    """The CLI reads the same rules: a run.toml with a hostile [cluster] table never starts."""
    run_toml = tmp_path / "run.toml"
    run_toml.write_text('output_dir = "."\ndataset = "d.toml"\n[model]\ntype = "flux"\ndiffusion_model = "x"\n'
                        'vae = "v"\ntext_encoders = ["t"]\n[cluster]\nlauncher = "pdsh"\nhosts = ["node-a:1"]\n'
                        '[cluster.env]\nPYTHONPATH = "/tmp/evil"\n')
    with pytest.raises(ConfigError, match=r"key 'cluster.env'.*'PYTHONPATH' would change the Python"):
        load_run_config(run_toml)


# --- the layer below: DeepSpeed's pdsh runner on what we write, run by bash ------------------------------------

EDGY = {"NCCL_DEBUG": "INFO; touch marker #", "NCCL_IB_HCA": "mlx5_0:1,mlx5_1:1", "OMP_NUM_THREADS": "4 & 5 | 6",
        "TORCH_DISTRIBUTED_DEBUG": "a*b?c ~ [x] {y} (z) <w> !v", "NCCL_ALGO": "Ring\u00e9"}


def with_our_env(runner, run_dir: Path):
    """DeepSpeed's runner given our ``.deepspeed_env`` as ``runner.main`` reads it (a line each, split at '=')."""
    for line in (run_dir / ".deepspeed_env").read_text().splitlines(keepends=True):
        key, value = line.split("=", maxsplit=1)
        runner.add_export(key, value)
    return runner


def test_values_the_rules_pass_stay_data_in_deepspeeds_pdsh_command(tmp_path):
    """Build DeepSpeed's own pdsh command from our hostfile, ``.deepspeed_env`` and launcher argv, then run the
    remote half in bash with the interpreter swapped for ``printf``: every variable arrives exactly as given,
    every argument is one word, and nothing else runs (no marker file)."""
    from deepspeed.launcher.multinode_runner import PDSHRunner
    from deepspeed.launcher.runner import parse_args

    run_dir = tmp_path / "run"
    cfg = carrier(tmp_path, env=EDGY, master_addr="10.0.0.1", nccl_socket_ifname="eth0,eth1")
    hostfile = prepare_run_folder(cfg, run_dir)
    save_toml(cfg, run_dir / "run.toml")
    [command] = node_commands(cfg, run_dir / "run.toml", hostfile, ["--resume", "r-1"])
    assert command.argv[:4] == [sys.executable, "-u", "-m", "deepspeed.launcher.runner"]
    args = parse_args(command.argv[4:])
    runner = with_our_env(PDSHRunner(args, "e30="), run_dir)
    cwd = os.getcwd()
    os.chdir(run_dir)     # DeepSpeed's runner runs in the run folder (``cd <run dir>`` in the remote command)
    try:
        cmd, _, _ = runner.get_cmd({}, {"node-a": [0], "node-b": [0]})
    finally:
        os.chdir(cwd)
    remote = cmd[cmd.index("-w") + 2:]        # pdsh joins the remaining words into the remote shell command
    shell = " ".join(remote).replace("%n", "1").replace(sys.executable, "printf '%s\\n'", 1)
    shell = shell.replace("printf '%s\\n'", "env -0 > env.out; printf '%s\\n'", 1)
    out = subprocess.run(["bash", "-c", shell], cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert not list(tmp_path.rglob("marker")) and not list(tmp_path.rglob(MARKER))
    env = dict(x.split("=", 1) for x in (run_dir / "env.out").read_text().split("\0") if "=" in x)
    for key, value in {**EDGY, "NCCL_SOCKET_IFNAME": "eth0,eth1"}.items():
        assert env[key] == value, key
    words = out.stdout.splitlines()
    assert words[:3] == ["-u", "-m", "deepspeed.launcher.launch"] and "--master_addr=10.0.0.1" in words
    assert words[-4:] == ["train", str(run_dir / "run.toml"), "--resume", "r-1"]


def test_a_run_folder_path_the_pdsh_shell_would_read_is_refused(tmp_path):
    run_dir = tmp_path / "runs;touch marker" / "r"
    cfg = carrier(tmp_path)
    hostfile = prepare_run_folder(cfg, run_dir)
    with pytest.raises(ConfigError, match="key 'cluster.launcher'.*pdsh's remote shell"):
        node_commands(cfg, run_dir / "run.toml", hostfile)
    cfg = carrier(tmp_path, launcher="no_ssh")       # no shell between us and the process: argv only
    assert node_commands(cfg, run_dir / "run.toml", hostfile)[0].argv[-1] == str(run_dir / "run.toml")


def test_nothing_in_a_run_folder_is_imported_by_the_processes_we_start(tmp_path):
    """``python -m`` puts the working folder (the run folder) first on sys.path; the child environment turns that
    off for the launcher and every process it starts, so a planted module is never imported."""
    from pipetrain.launcher.core import Launcher

    la = Launcher(tmp_path / "runs")
    run_dir = la.dirs.path("planted")
    run_dir.mkdir(parents=True)
    (run_dir / "run.toml").write_text("")
    marker = tmp_path / MARKER
    (run_dir / "json.py").write_text(f"open({str(marker)!r}, 'w').close()\n")        # shadows a module we use
    (run_dir / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    la.launch("planted", [sys.executable, "-m", "json.tool", "--help"], ())
    assert la.wait("planted", 30)
    assert not marker.exists(), (run_dir / "log.txt").read_text()
    assert "usage" in (run_dir / "log.txt").read_text()      # the real json.tool ran


def scan_refusal(folder: Path) -> str:
    """The message of the DatasetError scanning ``folder`` (on_unreadable = "error") raises."""
    from pipetrain.backend.config import DatasetConfig
    from pipetrain.backend.data import scan_dataset
    from pipetrain.backend.errors import DatasetError

    cfg = from_dict(DatasetConfig, {"directory": [{"path": str(folder)}], "resolutions": [64],
                                    "on_unreadable": "error"}, file="dataset.toml")
    with pytest.raises(DatasetError) as e:
        scan_dataset(cfg)
    return str(e.value)


def test_an_unreadable_caption_is_named_without_its_bytes(tmp_path):
    from PIL import Image

    Image.new("RGB", (64, 64)).save(tmp_path / "a.png")
    (tmp_path / "a.txt").write_bytes(b"ok \xfe secret caption")
    message = scan_refusal(tmp_path)
    assert "a.txt: caption file is not readable UTF-8 text (not UTF-8 at byte 3)" in message, message
    assert "0xfe" not in message and "secret" not in message


def test_values_the_rules_pass_add_no_variable_to_srun_export(tmp_path):
    """slurm: DeepSpeed's runner joins the variables into ``srun --export=ALL,K=V,...``; a value the rules pass
    never reads as another ``NAME=`` there."""
    import re

    from deepspeed.launcher.multinode_runner import SlurmRunner
    from deepspeed.launcher.runner import parse_args

    run_dir = tmp_path / "run"
    cfg = carrier(tmp_path, launcher="slurm", env=EDGY, nccl_socket_ifname="eth0,eth1")
    hostfile = prepare_run_folder(cfg, run_dir)
    [command] = node_commands(cfg, run_dir / "run.toml", hostfile)
    runner = with_our_env(SlurmRunner(parse_args(command.argv[4:]), "e30=", {"node-a": 1, "node-b": 1}), run_dir)
    [export] = [w for w in runner.get_cmd({}, {"node-a": [0], "node-b": [0]}) if w.startswith("--export=")]
    assigned = re.findall(r"(?:^--export=|,)([A-Za-z_][A-Za-z0-9_]*)=", export)
    assert sorted(assigned) == sorted([*EDGY, "NCCL_SOCKET_IFNAME"]), export
    with pytest.raises(ConfigError, match="srun --export reads as another variable"):
        cluster(launcher="slurm", env={"NCCL_DEBUG": "INFO,LD_PRELOAD=/tmp/evil.so"})


# --- the nodes: only declared inputs, within their bounds, reach a run key (issue #34, item 1) -----------------

@pytest.fixture(scope="module")
def nodes():
    from pipetrain.backend.host.runtime import ensure_comfyui
    ensure_comfyui()
    from pipetrain.nodes import settings, samples
    return settings, samples


def schedule_inputs(**changes) -> dict:
    from pipetrain.nodes.settings import ScheduleNode
    inputs = {i.id: i.default for i in ScheduleNode.define_schema().inputs if not i.optional}
    return {**inputs, **changes}


@pytest.mark.parametrize("name, value", [("model.vae", "/tmp/evil-vae.safetensors"), ("vae", "/tmp/x"),
                                         ("monitoring.wandb_api_key", "attackerkey0123456789"),
                                         ("monitoring", {"wandb_api_key": "attackerkey0123456789"}),
                                         ("output_dir", "/tmp"), ("lora_dir", "/etc"), ("dataset", "/dev/zero")])
def test_an_undeclared_input_reaches_no_run_key(nodes, name, value):
    """ComfyUI hands a node every linked input, declared or not: the Schedule node refuses one it does not
    declare, by name, instead of writing it into the run."""
    settings, _ = nodes
    with pytest.raises(ValueError, match=f"'{name}' is not an input of this node") as e:
        settings.ScheduleNode.execute(**schedule_inputs(**{name: value}))
    assert "attackerkey" not in str(e.value)


def test_every_node_refuses_undeclared_inputs_by_name(nodes):
    """Every node the extension registers, with a catch-all for its keys or without: an undeclared input is refused
    by its name before anything of the node runs."""
    from pipetrain.nodes import NODES
    assert len(NODES) >= 16
    for node in NODES:
        for name in ("model.vae", "output_dir", "run_id"):
            if name in {i.id for i in node.define_schema().inputs}:
                continue
            with pytest.raises(ValueError, match=f"'{name}' is not an input of this node"):
                node.execute(**{name: "/tmp/evil.safetensors"})


@pytest.mark.parametrize("name, value, problem", [
    ("epochs", 1_000_000_000, "outside 1 .. 100000"), ("epochs", 0, "outside 1 .. 100000"),
    ("epochs", True, "expected a whole number"), ("epochs", 2.5, "expected a whole number"),
    ("seed", -1, "outside"), ("save_every_n_epochs", 10**6, "outside 0 .. 10000"),   # named in validate_inputs
    ("checkpoint_every_n_minutes", float("nan"), "expected a finite number"),
    ("lr_scheduler", "../../etc", "not one of the node's choices"), ("wandb_run_name", 5, "expected text")])
def test_a_linked_value_is_held_to_the_widgets_bounds(nodes, name, value, problem):
    """ComfyUI checks min, max and options only on typed values: a Primitive node linked to ``epochs`` passes
    any number. The node holds it to the widget's range."""
    settings, _ = nodes
    with pytest.raises(ValueError, match=f"input '{name}'.*{problem}"):
        settings.ScheduleNode.execute(**schedule_inputs(**{name: value}))


def test_declared_inputs_in_range_still_make_their_keys(nodes):
    settings, _ = nodes
    patch = settings.ScheduleNode.execute(**schedule_inputs(epochs=100000, max_steps=7)).result[0]
    assert patch.get("epochs") == 100000 and patch.get("max_steps") == 7 and patch.get("model.vae") is None
    assert settings.OptimizerNode.defaults().get("optimizer.lr") == settings.start("optimizer.lr")


# --- no secret is written (issue #34, item 7) -------------------------------------------------------------------

KEY = "attackerKey0123456789"


def test_an_api_key_is_read_but_never_written(tmp_path):
    """A config's W&B key reaches the run's config in memory, never run.toml or the copy beside each LoRA."""
    from pipetrain.backend.config import load_run_config, without_secrets

    (tmp_path / "d.toml").write_text(f'resolutions = [64]\n[[directory]]\npath = "{tmp_path}"\n')
    written = ('output_dir = "."\ndataset = "d.toml"\n[model]\ntype = "flux"\ndiffusion_model = "x"\nvae = "v"\n'
               f'text_encoders = ["t"]\n[monitoring]\nenable_wandb = true\nwandb_api_key = "{KEY}"\n'
               'wandb_tracker_name = "proj"\n')
    (tmp_path / "run.toml").write_text(written)
    cfg = load_run_config(tmp_path / "run.toml", check_dataset=False)
    assert cfg.monitoring.wandb_api_key == KEY          # the run logs in with it
    save_toml(cfg, tmp_path / "again.toml")
    again = (tmp_path / "again.toml").read_text()
    assert KEY not in again and 'wandb_tracker_name = "proj"' in again and "enable_wandb = true" in again
    shared = without_secrets(written)                    # a run.toml written by hand, copied beside a LoRA
    assert KEY not in shared and "wandb_api_key" not in shared and 'wandb_tracker_name = "proj"' in shared
    plain = written.replace(f'wandb_api_key = "{KEY}"\n', "")
    assert without_secrets(plain) == plain               # nothing secret: the copy is the file as written


# --- config files and captions: regular files of bounded size only (issue #34, item 9) ---------------------------

def test_a_dataset_or_config_that_is_not_a_regular_file_is_refused_by_name(tmp_path):
    """``dataset = "/dev/zero"`` would be read until memory runs out, a FIFO would block for ever: each is refused
    before a byte is read, naming the key that names it."""
    from pipetrain.backend.config import load_run_config
    from pipetrain.backend.config.files import MAX_CONFIG

    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    big = tmp_path / "big.toml"
    big.write_text("# " + "x" * MAX_CONFIG + "\n")
    run = tmp_path / "run.toml"
    for dataset, problem in (("/dev/zero", "not a regular file"), (str(fifo), "not a regular file"),
                             (str(tmp_path), "not a regular file"), (str(big), "larger than 4096 KiB"),
                             (str(tmp_path / "missing.toml"), "file not found")):
        run.write_text(f'output_dir = "."\ndataset = "{dataset}"\n[model]\ntype = "flux"\ndiffusion_model = "x"\n'
                       'vae = "v"\ntext_encoders = ["t"]\n')
        with pytest.raises(ConfigError) as e:
            load_run_config(run)
        assert e.value.key == "dataset" and e.value.file == run and problem in str(e.value), str(e.value)
        assert dataset in str(e.value)
    for config in (Path("/dev/zero"), fifo, big):
        with pytest.raises(ConfigError, match="not a regular file|larger than"):
            load_run_config(config)


def test_a_caption_that_is_not_a_regular_file_is_named_unreadable(tmp_path):
    from PIL import Image

    for name in ("a", "b"):
        Image.new("RGB", (64, 64)).save(tmp_path / f"{name}.png")
    os.mkfifo(tmp_path / "a.txt")                   # reading it would block the scan for ever
    (tmp_path / "b.txt").symlink_to("/dev/zero")    # reading it would fill memory
    message = scan_refusal(tmp_path)
    assert "a.txt: caption file is not readable UTF-8 text (not a regular file)" in message, message
    assert "b.txt: caption file is not readable UTF-8 text (not a regular file)" in message, message


# --- file names of a folder a workflow names stay on the server (issue #34, item 8) -----------------------------

def test_a_control_folder_refusal_from_the_nodes_names_no_file_in_it(tmp_path):
    """The Train node's answer goes to whoever queued the prompt (/history): the pairing refusal says how many
    files are unpaired, never their names; the CLI's scan still lists them."""
    from PIL import Image

    from pipetrain.backend.config import DatasetConfig
    from pipetrain.backend.data import scan_dataset
    from pipetrain.backend.errors import DatasetError
    from pipetrain.launcher.build import check_edit_pairs

    train, private = tmp_path / "train", tmp_path / "private"
    for folder, names in ((train, ("a", "b")), (private, ("a", "secret-name-of-a-private-file"))):
        folder.mkdir()
        for name in names:
            Image.new("RGB", (64, 64)).save(folder / f"{name}.png")
    ds = from_dict(DatasetConfig, {"directory": [{"path": str(train), "control_path": str(private)}],
                                   "resolutions": [64]}, file="dataset.toml")
    with pytest.raises(DatasetError) as e:
        check_edit_pairs(ds, "flux_kontext", "dataset")
    message = str(e.value)
    assert "2 unpaired file(s)" in message and str(private) not in message.split("control_path")[-1], message
    assert "secret-name" not in message and "b.png" not in message, message
    with pytest.raises(DatasetError, match="secret-name-of-a-private-file"):
        scan_dataset(ds)


def test_the_cache_nodes_error_names_no_file_of_the_dataset(tmp_path):
    """The Cache node's child prints its refusal with the dataset's unreadable files listed; the node's message
    (which /history returns) keeps the refusal's first line and names the log, not the files."""
    from pipetrain.launcher.cache_job import ERROR_LINE, failure

    (tmp_path / "secret-name-of-a-private-file.png").write_bytes(b"not a picture")
    refusal = scan_refusal(tmp_path)
    log = tmp_path / "log.txt"
    log.write_text(f"loading\n{ERROR_LINE}{refusal}\n")       # as backend/cli.py reports it
    assert "secret-name" in log.read_text()
    message = str(failure(log, 2))
    assert "caching failed (exit code 2): 1 dataset file(s) cannot be read" in message and str(log) in message
    assert "secret-name" not in message, message


def test_an_epoch_lora_is_loaded_only_from_the_runs_own_folders(tmp_path):
    """Load Epoch LoRA loads the file a ``lora_saved`` event names: only one in the run's folder or its LoRA
    folder, never what a line of a run folder's file points elsewhere (#34, as the samples route)."""
    import json

    from pipetrain.backend.run.folder import RunsRoot
    from pipetrain.launcher.summaries import lora_for_epoch

    runs, lora_root = RunsRoot(tmp_path / "runs"), tmp_path / "loras"
    d = runs.path("run-l")
    (lora_root / "run-l").mkdir(parents=True)
    d.mkdir(parents=True)
    outside, other = tmp_path / "elsewhere.safetensors", runs.path("run-other") / "x.safetensors"
    other.parent.mkdir()
    own = lora_root / "run-l" / "run-l-epoch0001.safetensors"
    for path in (outside, other, own, d / "linked.safetensors"):
        if path.name == "linked.safetensors":
            path.symlink_to(outside)
        else:
            path.write_bytes(b"x")
    (d / "status.json").write_text(json.dumps({"state": "finished"}))
    with open(d / "events.jsonl", "w") as f:
        for epoch, path in enumerate((own, outside, other, d / "linked.safetensors"), start=1):
            f.write(json.dumps({"type": "lora_saved", "epoch": epoch, "step": epoch, "path": str(path)}) + "\n")
    assert lora_for_epoch(runs, "run-l", 1, lora_root)["path"] == str(own)
    for epoch in (2, 3, 4):
        assert lora_for_epoch(runs, "run-l", epoch, lora_root) is None, epoch
    assert lora_for_epoch(runs, "run-l", 0, lora_root)["epoch"] == 1


def test_a_run_folder_whose_files_are_fifos_or_folders_is_read_as_empty(tmp_path):
    """The panel reads every run's records on each poll: a FIFO in place of events.jsonl or status.json would
    block the reading thread for ever, a folder would fail it; each reads as nothing instead."""
    from pipetrain.backend.run.folder import RunsRoot
    from pipetrain.launcher.core import Launcher

    la = Launcher(tmp_path / "runs")
    d = la.dirs.path("run-odd")
    d.mkdir()
    (d / "run.toml").write_text("")
    os.mkfifo(d / "events.jsonl")
    os.mkfifo(d / "status.json")
    (d / "launcher.json").mkdir()
    (d / "checkpoints" / "latest").mkdir(parents=True)
    assert RunsRoot(tmp_path / "runs").ids() == ["run-odd"]
    [run] = la.list()
    assert (run["id"], run["state"], run["loras"], run["resumable"]) == ("run-odd", "unknown", [], False)
    assert la.get("run-odd")["events"] == []
