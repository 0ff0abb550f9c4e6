# SPDX-License-Identifier: GPL-3.0-or-later
"""The launcher over real detached processes (harmless Python children standing in for DeepSpeed)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from pipetrain.backend.errors import ConfigError, DatasetError, ModelError
from pipetrain.launcher.build import check_spec, write_config
from pipetrain.launcher.core import Launcher, LauncherError
from pipetrain.backend.run.folder import RunDir, RunIdError, RunsRoot, check_run_id, new_run_id, read_events
from pipetrain.launcher.summaries import lora_for_epoch, run_state, sample_file, saved_loras
from pipetrain.launcher.relay import EventRelay
from pipetrain.backend.config.patch import RunPatch
from pipetrain.launcher.forms import folder_patch, model_patch
from pipetrain.launcher.specs import DatasetSpec, ParallelismSpec, TrainSpec

pytestmark = pytest.mark.deepspeed_launcher   # tests/warm_ranks.py: why a real launch

REPO = Path(__file__).resolve().parents[2]

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]
# stands in for the backend: exits once the stop file appears, writing status "stopped"
GRACEFUL = [sys.executable, "-c", (
    "import json, os, time\n"
    "while not os.path.exists('stop'): time.sleep(0.02)\n"
    "json.dump({'state': 'stopped', 'last_checkpoint': 'x'}, open('status.json', 'w'))\n")]
IGNORES_STOP = [sys.executable, "-c", "import time\nwhile True: time.sleep(0.05)"]


@pytest.fixture
def launcher(tmp_path):
    made = []

    def make(**kw):
        kw.setdefault("stop_timeout", 30)
        la = Launcher(tmp_path / "runs", **kw)
        made.append(la)
        return la

    yield make
    for la in made:  # never leave a child behind
        for ref in la.procs.values():
            ref.signal_group(9)


def test_run_ids_are_strict(tmp_path):
    for bad in ["../x", "..", "a/b", "", ".hidden", "a b", "x" * 81, "cache", "a;rm -rf", "a\x00b", "run-1\n"]:
        with pytest.raises(RunIdError):
            check_run_id(bad)
    assert check_run_id(new_run_id("my lora/../v2")).startswith("my-lora-v2-")
    dirs = RunsRoot(tmp_path)
    with pytest.raises(RunIdError):
        dirs.path("..")
    (tmp_path / "outside").mkdir()
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "link").symlink_to(tmp_path / "outside")
    with pytest.raises(RunIdError):  # a symlink out of the root resolves outside it
        RunsRoot(tmp_path / "runs").path("link")


def test_launch_reattach_after_restart_and_kill(launcher):
    la = launcher()
    ref = la.launch("run-a", SLEEPER, (0, 1))
    info = json.loads((la.dirs.path("run-a") / "launcher.json").read_text())
    assert info["process"]["pid"] == ref.pid and info["gpus"] == [0, 1] and info["command"] == SLEEPER
    assert la.list()[0]["state"] == "launched" and la.list()[0]["alive"]

    restarted = launcher()  # a new ComfyUI process: nothing in memory, only the files
    assert restarted.reattach() == [] and "run-a" in restarted.procs
    assert restarted.alive("run-a")
    with pytest.raises(LauncherError, match="in use by run run-a"):
        restarted.launch("run-b", SLEEPER, (1,))
    restarted.launch("run-c", SLEEPER, (2,))  # other GPUs are fine

    summary = restarted.kill("run-a")
    assert summary["state"] == "killed" and not summary["alive"]
    assert not la.alive("run-a")
    restarted.launch("run-b", SLEEPER, (1,))  # GPU 1 is free again


def test_a_run_launched_elsewhere_is_seen_alive_once_its_process_is_recorded(launcher):
    """ComfyUI watches a run folder that another launcher (the CLI) fills: the folder shows before its process."""
    watcher, cli = launcher(), launcher()
    run_dir = watcher.dirs.path("run-x")
    run_dir.mkdir(parents=True)
    (run_dir / "run.toml").write_text("")
    assert watcher.list()[0]["id"] == "run-x" and not watcher.alive("run-x")   # no process recorded yet
    cli.launch("run-x", SLEEPER, (0,))
    assert watcher.alive("run-x") and watcher.list()[0]["alive"]
    cli.kill("run-x")
    assert not watcher.alive("run-x")
    cli.launch("run-x", SLEEPER, (0,))             # resumed by the CLI: a new process in a rewritten record
    assert watcher.alive("run-x")


def test_graceful_stop_uses_the_stop_file(launcher):
    la = launcher()
    la.launch("run-g", GRACEFUL, (0,))
    assert la.stop("run-g")["state"] in ("stopping", "launched", "stopped")
    assert la.wait("run-g", 20)
    s = la.get("run-g")
    assert s["state"] == "stopped" and not s["alive"]
    with pytest.raises(LauncherError, match="not running"):
        la.stop("run-g")


def test_stop_escalates_to_sigterm(launcher):
    la = launcher(stop_timeout=0.2)
    la.launch("run-t", IGNORES_STOP, (0,))
    la.stop("run-t")
    assert la.alive("run-t")
    end = time.monotonic() + 20
    while la.alive("run-t") and time.monotonic() < end:
        la.poll()
        time.sleep(0.05)
    assert not la.alive("run-t")
    s = la.get("run-t")
    assert s["state"] == "stopped" and not s["resumable"]  # stopped before any checkpoint


def run_toml_of(la: Launcher, run) -> None:
    """A run.toml as the launcher writes one (its output_dir the runs folder; the model files need not exist)."""
    from pipetrain.backend.config import RunConfig, save_toml
    from pipetrain.backend.config.schema import from_dict

    save_toml(from_dict(RunConfig, {"output_dir": str(la.dirs.root), "dataset": "dataset.toml",
                                    "model": {"type": "flux", "diffusion_model": "m", "vae": "v"}}), run.run_toml)


def test_control_requests_reach_a_live_run_only(launcher):
    from pipetrain.backend.run import control as run_control
    from pipetrain.backend.run.control import ControlValueError, Requests

    la = launcher()
    la.launch("run-c", SLEEPER, (0,))
    run = la.dirs.run("run-c")
    run.run_toml.write_text('[samples]\nprompts = ["a cat"]\n')
    for action in ("save", "sample", "stop_after_epoch"):
        assert la.control("run-c", action)["requested"]["action"] == action
    assert la.control("run-c", "lr", "2e-5")["requested"]["lr"] == 2e-5
    assert run_control.take(run)[0] == Requests(True, True, True, 2e-5)   # what the run's rank 0 reads
    with pytest.raises(ControlValueError, match="at most"):
        la.control("run-c", "lr", 1e4)
    with pytest.raises(ControlValueError, match="unknown run control"):
        la.control("run-c", "resume")
    run.run_toml.write_text("")
    with pytest.raises(LauncherError, match="no sample prompts"):
        la.control("run-c", "sample")
    la.control("run-c", "stop_after_epoch")
    la.kill("run-c")
    with pytest.raises(LauncherError, match="not running"):
        la.control("run-c", "save")
    with pytest.raises(KeyError):
        la.control("nope", "save")
    assert run_control.take(run)[0] == Requests(stop_after_epoch=True)   # left by the killed run ...
    run_control.request(run, "stop_after_epoch")
    (run.checkpoints / "step00000001").mkdir(parents=True)
    (run.checkpoints / "step00000001" / "pipetrain.json").write_text("{}")
    run_toml_of(la, run)                              # a resume runs a config of this runs folder only
    la.resume("run-c")                                                   # ... is forgotten by its resume
    assert run_control.take(run)[0] == Requests()


def test_unknown_runs(launcher):
    la = launcher()
    with pytest.raises(KeyError):
        la.get("nope")
    with pytest.raises(RunIdError):
        la.stop("../etc")


def test_state_rules():
    assert run_state({"state": "training"}, {}, alive=True) == "training"
    assert run_state({"state": "training"}, {"stop_requested": 1}, alive=True) == "stopping"
    assert run_state({"state": "training"}, {}, alive=False) == "failed"
    assert run_state({"state": "caching"}, {"stop_requested": 1}, alive=False) == "stopped"
    assert run_state({}, {"killed": 1}, alive=False) == "killed"
    assert run_state({"state": "finished"}, {}, alive=False) == "finished"
    # the backend writes "stopped" just before its processes exit: not "stopped" until they are gone
    assert run_state({"state": "stopped"}, {"stop_requested": 1}, alive=True) == "stopping"
    assert run_state({"state": "stopped"}, {"stop_requested": 1}, alive=False) == "stopped"
    # resumed: the status is the previous launch's ("stale") until the new process reports
    resumed = {"launches": 2}
    assert run_state({"state": "stopped"}, resumed, alive=True, stale=True) == "resuming"
    assert run_state({"state": "starting"}, resumed, alive=True, stale=False) == "starting"
    assert run_state({"state": "stopped"}, {**resumed, "stop_requested": 1}, alive=True, stale=True) == "stopping"
    assert run_state({"state": "stopped"}, resumed, alive=False, stale=True) == "failed"   # died before reporting


def test_a_relaunched_run_shows_resuming_until_it_reports_and_failed_if_it_never_does(launcher):
    """The lower half of Resume (``launch``) over a run whose last status is "stopped": no clocks, the status
    file's identity at launch tells the old status from the new process's."""
    la = launcher()
    la.launch("run-r", [sys.executable, "-c", "pass"], (0,))
    la.wait("run-r", 10)
    status = la.dirs.path("run-r") / "status.json"
    status.write_text(json.dumps({"state": "stopped", "step": 4}))
    # named as the trainer names checkpoints (``latest`` naming anything else is not followed)
    (la.dirs.path("run-r") / "checkpoints" / "step00000004").mkdir(parents=True)
    (la.dirs.path("run-r") / "checkpoints" / "step00000004" / "pipetrain.json").write_text("{}")   # marks it complete
    (la.dirs.path("run-r") / "checkpoints" / "latest").write_text("step00000004")
    assert la.get("run-r")["state"] == "stopped" and la.get("run-r")["resumable"]
    la.launch("run-r", [sys.executable, "-c", "import time; time.sleep(1.5)"], (0,))
    assert la.get("run-r")["state"] == "resuming"
    la.wait("run-r", 10)
    run = la.get("run-r")
    assert run["state"] == "failed" and "exited without reporting" in run["error"], run
    # a process that reports: its own state from its first write on
    la.launch("run-r", [sys.executable, "-c", "import json, time; json.dump({'state': 'loading'}, "
                        "open('status.json.tmp', 'w')); __import__('os').replace('status.json.tmp', 'status.json');"
                        " time.sleep(30)"], (0,))
    deadline = time.monotonic() + 10
    while la.get("run-r")["state"] != "loading" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert la.get("run-r")["state"] == "loading"
    status.write_text(json.dumps({"state": "finished", "step": 8}))
    la.kill("run-r")
    with pytest.raises(LauncherError, match="has finished"):
        la.resume("run-r")


def test_relay_sends_new_events_once(launcher):
    la = launcher()
    run_dir = la.dirs.path("run-e")
    run_dir.mkdir(parents=True)
    (run_dir / "status.json").write_text(json.dumps({"state": "training", "step": 1}))
    (run_dir / "events.jsonl").write_text(json.dumps({"type": "step", "step": 1, "loss": 0.5}) + "\n")
    sent = []
    relay = EventRelay(la, lambda event, data: sent.append((event, data)))
    relay.tick()
    assert sent and sent[0][1]["events"] == []  # history is not replayed; state change is reported
    sent.clear()
    with open(run_dir / "events.jsonl", "a") as f:
        f.write(json.dumps({"type": "step", "step": 2, "loss": 0.4}) + "\n" + '{"type": "st')  # partial line
    relay.tick()
    assert [e["step"] for e in sent[0][1]["events"]] == [2] and sent[0][0] == "pipetrain.event"
    sent.clear()
    relay.tick()
    assert sent == []
    events, _ = read_events(run_dir / "events.jsonl")
    assert len(events) == 2


def _spec(tmp_path, *, folder=None, model=None, gpus=2, stages=2) -> TrainSpec:
    files = {}
    for name in ("dm", "vae", "te1", "te2"):
        files[name] = tmp_path / f"{name}.safetensors"
        files[name].write_bytes(b"x")
    folder = folder or tmp_path / "images"
    folder.mkdir(exist_ok=True)
    (folder / "a.png").write_bytes(b"x")
    return TrainSpec(
        DatasetSpec((folder_patch(str(folder)),)),
        model_patch("flux", str(model or files["dm"]), str(files["vae"]), (str(files["te1"]), str(files["te2"]))),
        parallelism=ParallelismSpec(gpus=gpus, run=RunPatch.of({"pipeline_stages": stages})))


def test_specs_become_a_run_config_the_backend_loads(tmp_path):
    from pipetrain.backend.config import load_run_config

    run_toml = write_config(_spec(tmp_path), tmp_path / "run", output_dir=tmp_path / "out", run_name="r1",
                            lora_dir=tmp_path / "loras")
    cfg = load_run_config(run_toml)
    assert cfg.run_name == "r1" and cfg.pipeline_stages == 2 and cfg.model.type == "flux"
    assert cfg.dataset_config.directory[0].path == str(tmp_path / "images")


def test_bad_specs_are_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match="pipeline_stages"):
        check_spec(_spec(tmp_path, gpus=3, stages=2))
    with pytest.raises(ModelError, match="not found"):
        check_spec(_spec(tmp_path, model=tmp_path / "missing.safetensors"))
    empty = tmp_path / "empty"
    empty.mkdir()
    spec = _spec(tmp_path)
    with pytest.raises(DatasetError, match="no images"):
        check_spec(TrainSpec(DatasetSpec((folder_patch(str(empty)),)), spec.model))
    with pytest.raises(DatasetError, match="does not exist"):
        check_spec(TrainSpec(DatasetSpec((folder_patch(str(tmp_path / "nope")),)), spec.model))


def test_start_writes_the_run_and_spawns_deepspeed(tmp_path, launcher):
    """``start`` for real: the run folder, then DeepSpeed's launcher on our module, detached (killed at once)."""
    la = launcher(lora_root=tmp_path / "loras")
    run_id = la.start(_spec(tmp_path, gpus=1, stages=1), "my lora")
    run_dir = la.dirs.path(run_id)
    info = json.loads((run_dir / "launcher.json").read_text())
    la.kill(run_id)
    argv = info["command"]
    assert (run_dir / "run.toml").is_file() and (run_dir / "dataset.toml").is_file()
    assert argv[:4] == [sys.executable, "-u", str(REPO / "__main__.py"), "deepspeed"]   # exits by the run's status
    assert argv[argv.index("--num_gpus") + 1] == "1"
    assert argv[-3:] == [str(REPO / "__main__.py"), "train", str(run_dir / "run.toml")]   # the entry file, by path
    assert f'lora_dir = "{tmp_path / "loras" / run_id}"' in (run_dir / "run.toml").read_text()
    assert info["gpus"] == [0] and info["process"]["pgid"] == info["process"]["pid"]
    assert not la.alive(run_id)


def test_a_run_on_more_gpus_than_the_machine_shows_is_refused_before_anything_is_written(tmp_path, launcher):
    """Two GPUs asked of a machine with one: refused by index and count at the Train node, no run folder; a
    machine with none trains on CPU ranks, so it is not refused for that."""
    la = launcher(lora_root=tmp_path / "loras", gpu_count=lambda: 1)
    with pytest.raises(LauncherError, match=r"GPU\(s\) 1 asked for, but this machine shows 1 GPU\(s\) \(0\)"):
        la.start(_spec(tmp_path, gpus=2, stages=2), "two")
    assert la.dirs.ids() == []
    cpu_only = launcher(lora_root=tmp_path / "loras", gpu_count=lambda: 0)
    run_id = cpu_only.start(_spec(tmp_path, gpus=2, stages=2), "two")
    cpu_only.kill(run_id)
    assert json.loads((cpu_only.dirs.path(run_id) / "launcher.json").read_text())["gpus"] == [0, 1]


def test_loras_saved_before_a_resume_are_kept(launcher):
    """A resumed run's ``status.json`` starts afresh; its earlier epoch LoRAs come from ``events.jsonl``."""
    la = launcher()
    d = la.dirs.path("run-r")
    d.mkdir(parents=True)
    paths = {e: d / f"e{e}.safetensors" for e in (1, 2, 3)}
    for path in paths.values():
        path.write_bytes(b"x")
    with open(d / "events.jsonl", "w") as f:
        for e in (1, 2):
            f.write(json.dumps({"type": "lora_saved", "epoch": e, "step": 4 * e, "path": str(paths[e])}) + "\n")
        f.write(json.dumps({"type": "resume", "step": 9}) + "\n")
    (d / "status.json").write_text(json.dumps({"state": "training", "loras": [
        {"epoch": 3, "step": 12, "path": str(paths[3])}]}))
    assert [x["epoch"] for x in saved_loras(d)] == [1, 2, 3]
    assert [x["epoch"] for x in la.get("run-r")["loras"]] == [1, 2, 3]
    assert lora_for_epoch(la.dirs, "run-r", 1)["path"] == str(paths[1])
    assert lora_for_epoch(la.dirs, "run-r")["epoch"] == 3
    with open(d / "events.jsonl", "a") as f:  # read incrementally: a new event is picked up
        f.write(json.dumps({"type": "lora_saved", "epoch": 4, "step": 16, "path": str(d / "e4.safetensors")}) + "\n")
    (d / "e4.safetensors").write_bytes(b"x")
    assert lora_for_epoch(la.dirs, "run-r")["epoch"] == 4


def test_samples_of_a_step_lora_are_listed_apart_from_the_epochs(launcher):
    """"Sample now" renders with a step LoRA: its samples are shown and served, the LoRA never counts as an epoch's."""
    la = launcher()
    d = la.dirs.path("run-s")
    d.mkdir(parents=True)
    step_lora, plain = d / "run-s-step00000006.safetensors", d / "run-s-step00000008.safetensors"
    png = d / "run-s-step00000006-sample00.png"
    png.write_bytes(b"png")
    with open(d / "events.jsonl", "w") as f:
        for event in ({"type": "lora_saved", "epoch": 1, "step": 4, "path": str(d / "e1.safetensors")},
                      {"type": "step_lora_saved", "epoch": 2, "step": 6, "path": str(step_lora)},
                      {"type": "sample_saved", "epoch": 2, "step": 6, "path": str(png), "prompt": "a cat"},
                      {"type": "step_lora_saved", "epoch": 2, "step": 8, "path": str(plain)}):   # no samples
            f.write(json.dumps(event) + "\n")
    (d / "status.json").write_text(json.dumps({"state": "training"}))
    run = la.get("run-s")
    assert [(x["epoch"], x["step"]) for x in run["loras"]] == [(1, 4)]
    assert [(x["step"], x["path"], [s["prompt"] for s in x["samples"]]) for x in run["step_samples"]] == [
        (6, str(step_lora), ["a cat"])]
    assert sample_file(la.dirs, "run-s", png.name) == png
    assert lora_for_epoch(la.dirs, "run-s", 2) is None


# A stand-in for ``pipetrain train`` under DeepSpeed's real launcher: like the backend, SIGTERM only
# sets a flag; the rank then "checkpoints" and exits 0.
FAKE_RANK = """
import os, signal, time
flag = []
signal.signal(signal.SIGTERM, lambda *a: flag.append(1))
rank = os.environ["LOCAL_RANK"]
open(f"rank{rank}.ready", "w").close()
while not flag:
    time.sleep(0.02)
time.sleep(0.5)
open(f"rank{rank}.stopped", "w").close()
"""


def test_sigterm_escalation_reaches_the_ranks_under_deepspeeds_launcher(tmp_path, launcher, monkeypatch):
    """The escalation signals the ranks only: DeepSpeed's launch.py would turn a SIGTERM into killing
    them; here they finish their checkpoint and every process exits 0."""
    from pipetrain.backend.process.command_lines import free_port

    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "fake_rank.py").write_text(FAKE_RANK)
    monkeypatch.setenv("PYTHONPATH", str(mods))
    la = launcher(stop_timeout=0.0, kill_timeout=60)
    argv = [sys.executable, "-u", "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
            str(free_port()), "--module", "fake_rank"]
    ref = la.launch("run-ds", argv, (0, 1))
    d = la.dirs.path("run-ds")
    end = time.monotonic() + 60
    while not all((d / f"rank{r}.ready").exists() for r in (0, 1)):
        assert ref.popen.poll() is None, (d / "log.txt").read_text()
        assert time.monotonic() < end, (d / "log.txt").read_text()
        time.sleep(0.05)
    assert len(ref.ranks()) == 2
    la.stop("run-ds")                        # the stand-in ignores the stop file: escalate at once
    la.poll()
    assert la.wait("run-ds", 30), (d / "log.txt").read_text()
    assert all((d / f"rank{r}.stopped").exists() for r in (0, 1)), (d / "log.txt").read_text()
    assert ref.popen.returncode == 0, (d / "log.txt").read_text()


def test_a_full_fine_tunes_epoch_models_are_listed_but_never_loaded_as_loras(launcher):
    la = launcher()
    d = la.dirs.path("run-f")
    d.mkdir(parents=True)
    model = d / "models" / "run-f-epoch0001.safetensors"
    model.parent.mkdir()
    model.write_bytes(b"x")
    with open(d / "events.jsonl", "w") as f:
        f.write(json.dumps({"type": "model_saved", "epoch": 1, "step": 4, "path": str(model)}) + "\n")
        f.write(json.dumps({"type": "sample_saved", "epoch": 1, "path": str(model.with_suffix("")) + "-sample00.png",
                            "prompt": "a red circle"}) + "\n")
    (d / "status.json").write_text(json.dumps({"state": "finished", "models": [
        {"epoch": 1, "step": 4, "path": str(model)}]}))
    (listed,) = saved_loras(d)
    assert listed["kind"] == "model" and listed["path"] == str(model)
    assert [s["prompt"] for s in listed["samples"]] == ["a red circle"]
    assert lora_for_epoch(la.dirs, "run-f") is None


def test_resumable_as_the_backend_resumes_past_a_dangling_latest(tmp_path):
    """A kill while saving could leave ``latest`` naming a deleted folder; the backend then resumes from the
    newest complete checkpoint, so the run stays resumable. A folder without its completion mark is none."""
    from pipetrain.launcher.summaries import summarize

    dirs = RunsRoot(tmp_path / "runs")
    ckpts = dirs.path("run-k") / "checkpoints"
    (ckpts / "step00000005").mkdir(parents=True)                    # renamed in, never marked complete
    (ckpts / "latest").write_text("step00000009")
    assert not summarize(dirs, "run-k", False)["resumable"]
    (ckpts / "step00000003").mkdir()
    (ckpts / "step00000003" / "pipetrain.json").write_text("{}")
    assert summarize(dirs, "run-k", False)["resumable"]


def test_an_auto_run_that_cannot_fit_is_refused_at_queue_time_and_leaves_no_run(tiny_flux_files, make_run, launcher,
                                                                               tmp_path):
    """The Train node's path: ``start`` plans the run before its processes start; nothing fits a thousandth of a
    GiB, so nothing is launched and no run folder is left; a roomy limit starts and shows the plan."""
    from pipetrain.backend.config import load_run_config

    cfg = load_run_config(make_run(tiny_flux_files, images=2))
    files = cfg.model
    spec = TrainSpec(DatasetSpec((folder_patch(cfg.dataset_config.directory[0].path),)),
                     model_patch("flux", files.diffusion_model, files.vae, tuple(files.text_encoder_files)),
                     memory=RunPatch.of({"memory": "auto", "memory_limit_gib": 0.001}))
    la = launcher(lora_root=tmp_path / "loras")
    with pytest.raises(LauncherError, match="pipeline_stages"):
        la.start(spec, "too big")
    assert la.dirs.ids() == []
    roomy = TrainSpec(spec.dataset, spec.model, memory=RunPatch.of({"memory": "auto", "memory_limit_gib": 80}))
    run_id = la.start(roomy, "fits")
    la.kill(run_id)
    assert "memory = 'auto' chooses" in la.queue_plan(run_id)
    assert "memory = 'auto' chooses" in json.loads((la.dirs.path(run_id) / "launcher.json").read_text())["memory_plan"]
