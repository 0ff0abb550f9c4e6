"""Checkpoint and resume with real ranks: a run killed with SIGKILL after a checkpoint resumes at the
checkpointed step and ends with exactly the LoRA of an uninterrupted run (weights, optimizer state, LR
schedule and data position all restored); no final name ever holds a partial file.

The runs a test kills from outside go through DeepSpeed's launcher; the others (a reference, a resume, a run the stop
file ends from inside) fork from warm ranks (``conftest.train_warm``): DeepSpeed's runner plays no part in them."""
import json
import os
import signal
import time

import pytest
import torch
from conftest import Run, launch, train_on_a_thread, train_warm
from safetensors.torch import load_file

from pipetrain.backend.fsutil import KILL_AT_ENV

pytestmark = pytest.mark.slow

SETUP = dict(stages=2, epochs=3, checkpoint_every_n_epochs=1, lr_scheduler="cosine", warmup_steps=2,
             optimizer={"type": "adamw", "lr": 5e-3})


def _wait_for_event(run_dir_parent, type_, timeout=600, run=None):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert run is None or not run.done(), f"the run ended before a {type_} event:\n{run.result().output[-4000:]}"
        for events in run_dir_parent.glob("*/events.jsonl"):
            found = [json.loads(line) for line in events.read_text().splitlines() if f'"{type_}"' in line]
            if found:
                return found[0]
        time.sleep(0.2)
    raise TimeoutError(type_)


def _assert_no_partial_files(run_dir):
    for path in (run_dir / "loras").glob("*.safetensors"):
        load_file(str(path))  # a final name always holds a complete file
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert (run_dir / "checkpoints" / latest / "pipetrain.json").is_file()
    for d in (run_dir / "checkpoints").iterdir():
        if d.is_dir() and not d.name.startswith("."):
            assert (d / "pipetrain.json").is_file(), f"{d} is under a final name but incomplete"


def test_sigkill_after_checkpoint_then_resume(micro_flux_files, make_run):
    reference = train_warm(make_run(micro_flux_files, images=4, name="reference", **SETUP), ranks=2)
    assert reference.returncode == 0, reference.output[-3000:]

    config = make_run(micro_flux_files, images=4, name="killed", **SETUP)
    proc = launch(config, 2)
    checkpoint = _wait_for_event(config.parent / "output", "checkpoint")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    killed = Run(proc.returncode, "", config.parent / "output")
    _assert_no_partial_files(killed.run_dir)
    assert killed.status()["state"] != "finished"

    resumed = train_warm(config, 2, "--resume")
    assert resumed.returncode == 0, resumed.output[-3000:]
    resume_event = resumed.events("resume")[-1]
    assert resume_event["step"] >= checkpoint["step"]
    steps_after = [e["step"] for e in resumed.events("step") if e["time"] > resume_event["time"]]
    assert steps_after[0] == resume_event["step"] + 1
    assert resumed.status()["state"] == "finished"
    _assert_no_partial_files(resumed.run_dir)

    final, expected = load_file(str(resumed.loras()[-1])), load_file(str(reference.loras()[-1]))
    for key in expected:
        assert torch.allclose(final[key], expected[key], rtol=1e-4, atol=1e-6), key
    ref_losses = {e["step"]: e["loss"] for e in reference.events("step")}
    for e in resumed.events("step"):
        if e["time"] > resume_event["time"]:
            assert e["loss"] == pytest.approx(ref_losses[e["step"]], rel=1e-4)


def test_stop_file_checkpoints_and_exits(micro_flux_files, make_run):
    config = make_run(micro_flux_files, images=4, name="stopped", **{**SETUP, "epochs": 20})
    training = train_on_a_thread(config, 2)
    _wait_for_event(config.parent / "output", "step", run=training)
    run_dir = next((config.parent / "output").glob("2*"))
    (run_dir / "stop").touch()
    run = training.result()
    assert run.returncode == 0, run.output[-3000:]
    assert run.status()["state"] == "stopped"
    stopped = run.events("stopped")[-1]
    assert run.events("checkpoint")[-1]["step"] == stopped["step"] < 80
    assert run.events("step")[-1]["step"] == stopped["step"]        # the last step is reported before the stop
    assert not (run_dir / "stop").exists()


def test_resume_with_more_data_parallel_ranks(micro_flux_files, make_run, monkeypatch):
    """Resume a 2-rank (2 stages x 1) run on 4 ranks (2 stages x 2), as after adding a node: the epoch
    position carries over in examples, the remaining epochs run with the larger global batch. The 2-rank run is
    killed (SIGKILL) from inside, as epoch 2's LoRA is being written, after epoch 1's checkpoint: what is resumed is
    the checkpoint, however the run died, so it forks from warm ranks (no launch of DeepSpeed's to kill)."""
    config = make_run(micro_flux_files, images=4, name="grow", stages=2, epochs=3, checkpoint_every_n_epochs=1)
    dataset = config.with_name("dataset.toml")
    dataset.write_text(dataset.read_text().replace("enable_ar_bucket = true", "enable_ar_bucket = false"))
    monkeypatch.setenv(KILL_AT_ENV, "lora-written:2")
    killed = train_warm(config, 2)
    monkeypatch.delenv(KILL_AT_ENV)
    assert killed.returncode != 0 and killed.status()["state"] != "finished", killed.output[-3000:]
    checkpoint = killed.events("checkpoint")[0]
    assert checkpoint["step"] == 4                       # epoch 1: 4 images, global batch 1

    resumed = train_warm(config, 4, "--resume")
    assert resumed.returncode == 0, resumed.output[-3000:]
    event = resumed.events("resume")[-1]
    assert (event["saved_global_batch"], event["global_batch"], event["step"]) == (1, 2, 4)
    assert resumed.status()["state"] == "finished" and resumed.status()["step"] == 8   # + 2 epochs of 2 steps
    assert [e["epoch"] for e in resumed.events("lora_saved")][-2:] == [2, 3]
    assert resumed.events("start")[-1]["world_size"] == 4


def test_resume_that_ends_in_the_last_saved_epoch_saves_its_weights(micro_flux_files, make_run):
    """A run that stops at ``max_steps`` in epoch 2 writes that epoch's LoRA; resumed with a later ``max_steps``
    still in epoch 2, the steps it trains end up in a LoRA too (the epoch's file, now holding the later step)."""
    config = make_run(micro_flux_files, images=4, name="extend", stages=2, epochs=3, max_steps=6)
    first = train_warm(config, 2)
    assert first.returncode == 0, first.output[-3000:]
    assert [(e["epoch"], e["step"]) for e in first.events("lora_saved")] == [(1, 4), (2, 6)]
    before = load_file(str(first.loras()[-1]))

    config.write_text(config.read_text().replace("max_steps = 6", "max_steps = 7"))
    resumed = train_warm(config, 2, "--resume")
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert resumed.status()["step"] == 7
    resume_time = resumed.events("resume")[-1]["time"]
    after_resume = [e for e in resumed.events("lora_saved") if e["time"] > resume_time]
    assert [(e["epoch"], e["step"]) for e in after_resume] == [(2, 7)]
    assert resumed.status()["loras"][-1]["step"] == 7
    final = load_file(after_resume[0]["path"])
    assert any(not torch.equal(final[k], before[k]) for k in before)   # step 7's weights, not step 6's
