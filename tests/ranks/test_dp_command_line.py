"""diffusion-pipe's own command line trains: ``python -m pipetrain deepspeed --num_gpus=2 train.py --deepspeed
--config run.toml`` on 2 CPU ranks as 2 stages, then ``--resume_from_checkpoint RUN --reset_optimizer_params``
continues that run with the learning rate of the config it is given (diffusion-pipe's meaning: the optimizer's
moments from the checkpoint, its settings from the new config). The runs about diffusion-pipe's config keys rather
than its command line fork from warm ranks (``conftest.train``) with its ``--deepspeed`` switch: the launcher's part
is the first run's (the resume's flags pass DeepSpeed's launcher untouched, ``dp_cli.script_as_command``, and are
read by the ranks' ``train`` parser, so the resume forks from warm ranks too)."""
from __future__ import annotations

import os
import subprocess

import tomli_w
from conftest import Run, train

from pipetrain.backend.process.command_lines import free_port, pipetrain_command
from pipetrain.backend.config.files import _read_toml


def _dp_line(config, *flags: str) -> Run:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}   # CPU ranks, as in CI
    command = pipetrain_command("deepspeed", "--num_gpus=2", "--master_port", str(free_port()), "train.py",
                                "--deepspeed", "--config", config.name, *flags, "--no-progress")
    done = subprocess.run(command, cwd=config.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=900)
    return Run(done.returncode, done.stdout, config.parent / "output")


def test_dp_command_line_trains_and_resumes_with_the_new_configs_optimizer_settings(micro_flux_files, make_run):
    config = make_run(micro_flux_files, images=2, name="dp", stages=2, epochs=1)
    first = _dp_line(config)
    assert first.returncode == 0, first.output[-4000:]
    assert first.status()["state"] == "finished" and first.events("start")[0]["pipeline_stages"] == 2
    assert {e["lr"] for e in first.events("step")} == {2e-3} and first.loras()
    run = first.run_dir.name

    table = _read_toml(config)
    table["epochs"], table["optimizer"]["lr"] = 2, 5e-4
    config.write_text(tomli_w.dumps(table))
    resumed = train(config, 2, "--deepspeed", "--resume_from_checkpoint", run, "--reset_optimizer_params")
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert resumed.run_dir.name == run and resumed.events("resume")[-1]["step"] == 2
    steps = [e for e in resumed.events("step") if e["step"] > 2]
    assert [e["epoch"] for e in steps] == [2, 2] and {e["lr"] for e in steps} == {5e-4}


def test_force_constant_lr_and_resume_from_checkpoint_as_keys(micro_flux_files, make_run):
    """diffusion-pipe's ``force_constant_lr``: every step at that rate, no warm-up, a resumed run too (its
    checkpoint's rate and schedule not taken); ``resume_from_checkpoint = true`` in the config resumes the newest
    run as the flag does."""
    config = make_run(micro_flux_files, images=2, name="dpk", stages=2, epochs=1)
    table = _read_toml(config)
    table["warmup_steps"], table["force_constant_lr"] = 4, 1e-3   # without the key: 5e-4, 1e-3 (the warm-up)
    config.write_text(tomli_w.dumps(table))
    first = train(config, 2, "--deepspeed")
    assert first.returncode == 0, first.output[-4000:]
    assert [e["lr"] for e in first.events("step")] == [1e-3, 1e-3]

    table["epochs"], table["force_constant_lr"], table["resume_from_checkpoint"] = 2, 2.5e-4, True
    config.write_text(tomli_w.dumps(table))
    resumed = train(config, 2, "--deepspeed")
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert resumed.run_dir.name == first.run_dir.name and resumed.events("resume")[-1]["step"] == 2
    assert [e["lr"] for e in resumed.events("step") if e["step"] > 2] == [2.5e-4, 2.5e-4]
