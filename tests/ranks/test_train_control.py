# SPDX-License-Identifier: GPL-3.0-or-later
"""Run control with real ranks (2 gloo ranks, a 2-stage pipeline): while the run trains, a new learning rate shows
in the logged LR from the step after the one that took it and survives a resume; save now writes a step LoRA and a
checkpoint at one step; sample now renders the sample prompts with a step LoRA; stop after this epoch ends the run
at the epoch's boundary with a checkpoint, resumable. The runs that only files steer fork from warm ranks
(``conftest.train_on_a_thread``); the ones signalled from outside go through DeepSpeed's launcher."""
import json
import os
import signal
import subprocess
import time
from concurrent.futures import Future

import psutil
import pytest
import torch
from conftest import train, train_on_a_thread
from PIL import Image
from safetensors.torch import load_file

from pipetrain.backend.run import control as run_control
from pipetrain.backend.process.command_lines import deepspeed_cli_command
from pipetrain.backend.run.folder import RunDir, RunsRoot
from pipetrain.launcher.summaries import summarize

pytestmark = pytest.mark.slow

OLD_LR, NEW_LR = 2e-3, 7.5e-4
STEPS_PER_EPOCH = 4   # 4 images, global batch 1
SAMPLES = {"prompts": ["a red circle"], "seed": 3, "width": 64, "height": 64, "steps": 2}


def _events(run_dir, type_, **match) -> list[dict]:
    try:
        lines = (run_dir / "events.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    events = [json.loads(line) for line in lines if line.strip()]
    return [e for e in events if e["type"] == type_ and all(e.get(k) == v for k, v in match.items())]


def _ended(run) -> str | None:
    """The output of a run that has ended (a launched process, or a warm run's future), None while it trains."""
    if isinstance(run, Future):
        return run.result().output if run.done() else None
    return run.communicate()[0] if run.poll() is not None else None


def _wait(run, output, type_, timeout=600, **match) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for run_dir in output.glob("2*"):
            if found := _events(run_dir, type_, **match):
                return found[0]
        ended = _ended(run)
        assert ended is None, f"the run ended before a {type_} event:\n{ended[-4000:]}"
        time.sleep(0.1)
    raise TimeoutError(type_)


def test_save_sample_lr_and_stop_after_epoch_while_training_then_resume(micro_flux_files, make_run):
    config = make_run(micro_flux_files, images=4, name="control", stages=2, epochs=6, samples=SAMPLES,
                      lr_scheduler="constant", save_every_n_epochs=100, checkpoint_every_n_epochs=100,
                      optimizer={"type": "adamw", "lr": OLD_LR})
    output = config.parent / "output"
    training = train_on_a_thread(config, 2)
    try:
        _wait(training, output, "step")
        run_dir = RunDir(next(output.glob("2*")))
        for action in ("save", "sample"):
            run_control.request(run_dir, action)
        run_control.request(run_dir, "lr", NEW_LR)
        _wait(training, output, "sample_saved")               # the samples hold every rank: the run waits for them
    finally:   # after a failed wait too: the run ends at its epoch's boundary, not after six epochs
        for folder in output.glob("2*"):
            run_control.request(RunDir(folder), "stop_after_epoch")
        run = training.result()
    assert run.returncode == 0, run.output[-4000:]
    acted = {e["action"]: e for e in run.events("control")}
    assert set(acted) == {"save", "sample", "lr", "stop_after_epoch"}, run.events("control")

    # the new learning rate: logged from the step after the one that took it, the config's before
    lr = acted["lr"]
    assert lr["lr"] == NEW_LR and lr["from_step"] == lr["step"] + 1
    logged = {e["step"]: e["lr"] for e in run.events("step")}
    assert {s: v for s, v in logged.items() if s <= lr["step"]} == {s: OLD_LR for s in range(1, lr["step"] + 1)}
    assert set(v for s, v in logged.items() if s > lr["step"]) == {NEW_LR}

    # save now: a step LoRA and a checkpoint, both of the step that took the request
    step = acted["save"]["step"]
    saved = run.events("step_lora_saved")
    assert [e["step"] for e in saved] == [step] and load_file(saved[0]["path"])
    checkpoints = {e["step"]: e["path"] for e in run.events("checkpoint")}
    assert step in checkpoints and (run.run_dir / "checkpoints" / f"step{step:08d}" / "pipetrain.json").is_file()

    # sample now: the prompts rendered with that step LoRA, beside it
    samples = run.events("sample_saved")
    assert [(e["step"], e["prompt"]) for e in samples] == [(acted["sample"]["step"], "a red circle")]
    assert samples[0]["path"].startswith(saved[0]["path"].removesuffix(".safetensors"))
    assert Image.open(samples[0]["path"]).size == (64, 64)
    listed = summarize(RunsRoot(output), run.run_dir.name, False)      # what the panel shows of them
    assert [s["path"] for x in listed["step_samples"] for s in x["samples"]] == [samples[0]["path"]]

    # stop after this epoch: at the boundary of the epoch that took it, with a checkpoint; resumable
    stopped = run.events("stopped")[-1]
    epoch = acted["stop_after_epoch"]["epoch"]
    assert stopped["after_epoch"] == epoch and stopped["step"] == epoch * STEPS_PER_EPOCH < 6 * STEPS_PER_EPOCH
    assert run.events("step")[-1]["step"] == stopped["step"] and stopped["step"] in checkpoints
    assert run.status()["state"] == "stopped" and run.status()["stop_after_epoch"] is None   # no longer pending
    kept = json.loads((run.run_dir / "checkpoints" / f"step{stopped['step']:08d}" / "pipetrain.json").read_text())
    assert kept["base_lr"] == NEW_LR

    resumed = train(config, 2, "--resume")
    assert resumed.returncode == 0, resumed.output[-4000:]
    resume = resumed.events("resume")[-1]
    assert resume["step"] == stopped["step"] and resume["base_lr"] == NEW_LR
    after = [e["lr"] for e in resumed.events("step") if e["time"] > resume["time"]]
    assert len(after) == 6 * STEPS_PER_EPOCH - stopped["step"] and set(after) == {NEW_LR}
    assert resumed.status()["state"] == "finished"


def _cli(config, *extra) -> subprocess.Popen:
    """``python -m pipetrain deepspeed ... train`` (2 ranks) in its own process group, as a terminal runs it."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if torch.cuda.device_count() == 1:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.Popen(deepspeed_cli_command("train", config, 2, list(extra)) + ["--no-progress"],
                            cwd=config.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)


def _steps_after_start(run_dir, n: int) -> list[dict]:
    """The step events after the ``n``-th start event (counting from 1), none before it is written."""
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]
    starts = [i for i, e in enumerate(events) if e["type"] == "start"]
    return [e for e in events[starts[n - 1]:] if e["type"] == "step"] if len(starts) >= n else []


def _wait_for(condition, proc, timeout=600):
    end = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        assert time.monotonic() < end, "timed out"
        time.sleep(0.1)


def test_lr_change_survives_a_kill_and_signals_stop_after_a_checkpoint_with_the_cli_saying_so(micro_flux_files,
                                                                                               make_run):
    """An acknowledged learning rate, the launcher and ranks killed (-9) before any checkpoint: the CLI says the
    run did not finish, and the resumed steps train at the new rate. Ctrl-C (SIGINT to the group), then SIGTERM to
    the CLI alone: each checkpoints at the next step and stops, the status says why, the exit status is 128 + the
    signal's number."""
    config = make_run(micro_flux_files, images=4, name="durable", stages=2, epochs=1000, lr_scheduler="constant",
                      save_every_n_epochs=1000, checkpoint_every_n_epochs=1000,
                      optimizer={"type": "adamw", "lr": OLD_LR})
    output = config.parent / "output"
    first = _cli(config)
    try:
        _wait(first, output, "step")
        run_dir = next(output.glob("2*"))
        run_control.request(run_dir, "lr", NEW_LR)
        _wait(first, output, "control", action="lr")
        assert json.loads((run_dir / "status.json").read_text())["base_lr"] == NEW_LR   # acknowledged
        below = psutil.Process(first.pid).children(recursive=True)   # DeepSpeed's launch.py and the ranks
        assert len(below) == 3
        for p in below:
            p.kill()
        out, _ = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert not list((run_dir / "checkpoints").glob("step*"))
    assert first.returncode != 0 and f"pipetrain: the run in {run_dir} did not finish" in out, out[-3000:]

    for n, (sig, to_group) in enumerate(((signal.SIGINT, True), (signal.SIGTERM, False)), 2):
        proc = _cli(config, "--resume", run_dir.name)
        try:
            _wait_for(lambda: len(_steps_after_start(run_dir, n)) >= 2, proc)
            (os.killpg if to_group else os.kill)(proc.pid, sig)
            out, _ = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        assert proc.returncode == 128 + sig, out[-4000:]
        status = json.loads((run_dir / "status.json").read_text())
        assert status["state"] == "stopped" and status["stop_reason"].startswith(f"{sig.name}"), status
        assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-4000:]
        steps = _steps_after_start(run_dir, n)
        assert {e["lr"] for e in steps} == {NEW_LR}                 # the resumed steps: the acknowledged rate
        assert (run_dir / "checkpoints" / f"step{steps[-1]['step']:08d}" / "pipetrain.json").is_file()
