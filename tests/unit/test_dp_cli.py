"""diffusion-pipe's command line, parsed in-process (``backend/process/dp_cli.py``): ``train.py --deepspeed --config X``
and its underscore flags mean here what they mean in diffusion-pipe, the flags of no equivalent are refused naming what
to use; ``tests/ranks/test_dp_command_line.py`` trains with that line."""
from __future__ import annotations

import pytest

from pipetrain.backend.cli import _parser
from pipetrain.backend.process.dp_cli import script_as_command


def _train_args(*argv: str):
    args = _parser().parse_args(["train", *argv])
    args.check(args)
    return args


def test_dp_flags_set_what_ours_set():
    dp = _train_args("--deepspeed", "--config", "x.toml", "--resume_from_checkpoint", "20261202-143950",
                     "--regenerate_cache", "--trust_cache", "--reset_dataloader", "--reset_optimizer_params")
    ours = _train_args("x.toml", "--resume", "20261202-143950", "--regenerate-cache", "--trust-cache",
                       "--reset-dataloader", "--reset-optimizer-params")
    fields = ("config", "resume", "regenerate_cache", "trust_cache", "cache_only", "reset_dataloader",
              "reset_optimizer", "reset_optimizer_params")
    assert [getattr(dp, f) for f in fields] == [getattr(ours, f) for f in fields] == [
        "x.toml", "20261202-143950", True, True, False, True, False, True]
    newest = _train_args("--config", "x.toml", "--resume_from_checkpoint", "--reset_optimizer")
    assert (newest.resume, newest.reset_optimizer) == ("", True)   # no value: the newest run, as --resume
    assert _train_args("--config", "x.toml", "--cache_only").cache_only


@pytest.mark.parametrize("argv, message", [
    (["--config", "x.toml", "--dump_dataset", "/tmp/dump"], "--dump_dataset: diffusion-pipe's flag is not built here"),
    (["--config", "x.toml", "--test_sample"], "python -m pipetrain sample CONFIG LORA"),
    (["--config", "x.toml", "--master_port", "29501"], "deepspeed --master_port PORT"),
    (["--config", "x.toml", "--reset_dataloader"], "--reset_dataloader changes what a resume loads; add --resume"),
    (["x.toml", "--config", "y.toml"], "give the run config once"),
    ([], "give the run config once"),
])
def test_what_has_no_meaning_here_is_refused_naming_what_to_use(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        _train_args(*argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "usage: python -m pipetrain train" in err and message in err, err


@pytest.mark.parametrize("launcher", [["--num_gpus=1"], ["--num_gpus", "2", "--master_port", "29501"],
                                      ["--include", "localhost:0,1"]])
def test_dp_script_is_the_train_command(launcher):
    """``python -m pipetrain deepspeed <launcher options> train.py --deepspeed --config X``: DeepSpeed's runner
    starts our entry file's train command with the same options; any other script is left as it is."""
    dp = [*launcher, "train.py", "--deepspeed", "--config", "train.py.toml"]
    assert script_as_command(dp, "/p/__main__.py") == [*launcher, "/p/__main__.py", "train", "--deepspeed",
                                                       "--config", "train.py.toml"]
    for other in ([*launcher, "--module", "pipetrain", "train", "x.toml"], [*launcher, "my_train.py", "--config", "x"]):
        assert script_as_command(other, "/p/__main__.py") == other


@pytest.mark.parametrize("value, resume", [("true", ""), ("'20261202-143950'", "20261202-143950"), ("false", None)])
def test_the_configs_resume_from_checkpoint_is_the_flag_where_the_command_line_gives_none(tmp_path, value, resume):
    config = tmp_path / "x.toml"
    config.write_text(f"resume_from_checkpoint = {value}\n")
    assert _train_args("--config", str(config)).resume == resume
    assert _train_args("--config", str(config), "--resume_from_checkpoint", "other").resume == "other"   # flag wins
    if resume is not None:   # a resume from the key takes the reset flags
        assert _train_args("--config", str(config), "--reset_optimizer").reset_optimizer


def test_a_resume_from_checkpoint_of_another_kind_is_refused_naming_the_key(tmp_path, capsys):
    config = tmp_path / "x.toml"
    config.write_text("resume_from_checkpoint = 3\n")
    with pytest.raises(SystemExit):
        _train_args("--config", str(config))
    assert "key 'resume_from_checkpoint'" in capsys.readouterr().err
