# SPDX-License-Identifier: GPL-3.0-or-later
"""diffusion-pipe's command line, as its users type it.

diffusion-pipe runs ``deepspeed --num_gpus=1 train.py --deepspeed --config X.toml [flags]``. Here the same line
runs with ``python -m pipetrain`` in front: ``python -m pipetrain deepspeed --num_gpus=1 train.py --deepspeed
--config X.toml`` (``deepspeed_cli`` reads the script ``train.py`` as PipeTrain's ``train`` command), and so does
``deepspeed --num_gpus=1 --module pipetrain train --deepspeed --config X.toml``. The ``train`` command takes
diffusion-pipe's flags with their meaning: ``--config``, ``--deepspeed`` (DeepSpeed's own switch, always on here),
``--resume_from_checkpoint [RUN]``, ``--regenerate_cache``, ``--cache_only``, ``--trust_cache``,
``--reset_dataloader``, ``--reset_optimizer`` and ``--reset_optimizer_params``; the flags whose work PipeTrain
does elsewhere are refused naming what to use. The config's ``resume_from_checkpoint`` key means what the flag means
where the command line gives none (diffusion-pipe's order).
"""
from __future__ import annotations

import argparse

from ..errors import ConfigError, PipeTrainError

SCRIPT = "train.py"   # diffusion-pipe's entry script: PipeTrain's train command
# diffusion-pipe's flags of no equivalent here -> why, and what to use instead
REFUSED = {
    "dump_dataset": "PipeTrain's cache holds the latents of the dataset's own files, which train as scanned: look "
                    "at the dataset folder (python -m pipetrain check-config lists what it reads), or render what "
                    "the model learnt with [samples] / python -m pipetrain sample CONFIG LORA",
    "test_sample": "render with python -m pipetrain sample CONFIG LORA (ComfyUI's sampler), or [samples] in the config",
    "i_know_what_i_am_doing": "PipeTrain has no checks to skip: each refusal names the key and the fix",
    "master_port": "give it to DeepSpeed's launcher, before the script: deepspeed --master_port PORT ...",
}


def add_train_options(train: argparse.ArgumentParser) -> None:
    """diffusion-pipe's spellings on PipeTrain's ``train`` parser (ours, with hyphens, stay)."""
    train.add_argument("--config", dest="config_option", default=None, metavar="CONFIG",
                       help="the run config (diffusion-pipe's spelling of the positional CONFIG)")
    train.add_argument("--deepspeed", action="store_true", help="accepted: DeepSpeed's switch (always on here)")
    train.add_argument("--reset-dataloader", "--reset_dataloader", dest="reset_dataloader", action="store_true",
                       help="on --resume: keep the epoch, start its data from the beginning")
    train.add_argument("--reset-optimizer", "--reset_optimizer", dest="reset_optimizer", action="store_true",
                       help="on --resume: load neither the optimizer's state nor the learning-rate schedule's")
    train.add_argument("--reset-optimizer-params", "--reset_optimizer_params", dest="reset_optimizer_params",
                       action="store_true", help="on --resume: load the optimizer's state but take its settings "
                       "(lr, betas, weight decay) from the config, and start the learning-rate schedule again")
    for flag in REFUSED:
        train.add_argument(f"--{flag}", nargs="?", const=True, default=None, help=argparse.SUPPRESS)


def check_train_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """One config (positional or --config); the reset flags only with a resume; the refused flags with their
    reason (``parser.error`` exits 2, as argparse does for any bad argument)."""
    refused = [flag for flag in REFUSED if getattr(args, flag) is not None]
    if refused:
        parser.error(f"--{refused[0]}: diffusion-pipe's flag is not built here; {REFUSED[refused[0]]}")
    if (args.config is None) == (args.config_option is None):
        parser.error("give the run config once: python -m pipetrain train CONFIG, or --config CONFIG "
                     "(diffusion-pipe's spelling)")
    args.config = args.config or args.config_option
    if args.resume is None:
        try:
            args.resume = config_resume(args.config)
        except PipeTrainError as e:
            parser.error(str(e))
    resets = [name for name in ("reset_dataloader", "reset_optimizer", "reset_optimizer_params") if getattr(args, name)]
    if resets and args.resume is None:
        parser.error(f"--{resets[0]} changes what a resume loads; add --resume [RUN] (diffusion-pipe's "
                     "--resume_from_checkpoint [RUN])")


def config_resume(path) -> str | None:
    """The run config's ``resume_from_checkpoint`` as ``--resume``'s value: true is "" (the newest run with a
    checkpoint), a string that run's folder name in ``output_dir``, false or left out None (no resume)."""
    from ..config.files import _read_toml

    try:
        value = _read_toml(path).get("resume_from_checkpoint", False)
    except PipeTrainError:
        return None   # loading the config names the problem
    if value is False:
        return None
    if value is True:
        return ""
    if isinstance(value, str) and value:
        return value
    raise ConfigError(f"got a {type(value).__name__}; true resumes the newest run of output_dir, a run's folder name "
                      "that run", file=path, key="resume_from_checkpoint")


def script_as_command(args: list[str], entry: str) -> list[str]:
    """DeepSpeed launcher options with diffusion-pipe's script ``train.py`` as the user script: the same options
    with PipeTrain's entry file and its ``train`` command in its place; any other script as it is."""
    from deepspeed.launcher.runner import parse_args

    parsed = parse_args(list(args))
    if parsed.module or parsed.no_python or parsed.user_script != SCRIPT:
        return list(args)
    at = len(args) - len(parsed.user_args) - 1   # the script is the first token of the launcher's remainder
    if args[at] != SCRIPT:
        return list(args)
    return [*args[:at], entry, "train", *args[at + 1:]]
