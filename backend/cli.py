"""``python -m pipetrain COMMAND``: parse, build the RunConfig, run the named phase.

Commands: cache, train, launch, sample, check-config, memory-plan, doctor, demo.

Run ``cache`` and ``train`` under DeepSpeed's launcher for several ranks, e.g.
``deepspeed --num_gpus 2 --module pipetrain train run.toml``; a plain ``python -m pipetrain train``
runs one rank. diffusion-pipe's line ``deepspeed --num_gpus=1 train.py --deepspeed --config X`` runs as
``python -m pipetrain deepspeed --num_gpus=1 train.py --deepspeed --config X`` (``process/dp_cli.py``).
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import sys

from .process.dp_cli import add_train_options, check_train_args
from .errors import PipeTrainError
from .fsutil import OUT_OF_SPACE_EXIT, OutOfSpace


DESCRIPTION = ("Train diffusion-model LoRAs with DeepSpeed pipeline parallelism on ComfyUI's model code. Each command "
               "takes -h; the ComfyUI used is COMFYUI_PATH, --comfyui PATH, or the one this package or this Python "
               "sits in.")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipetrain", description=DESCRIPTION)
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command", required=True)
    cache = sub.add_parser("cache", help="encode latents and text embeddings, then exit")
    cache.add_argument("config")
    cache.add_argument("--regenerate-cache", action="store_true", help="delete the cache and encode everything again")
    train = sub.add_parser("train", help="cache what is missing, then train (diffusion-pipe's flags too: "
                                         "backend/process/dp_cli.py)")
    train.add_argument("config", nargs="?", default=None)
    train.add_argument("--resume", "--resume_from_checkpoint", nargs="?", const="", default=None, metavar="RUN",
                       help="resume the newest run with a checkpoint, or the named run directory")
    train.add_argument("--regenerate-cache", "--regenerate_cache", dest="regenerate_cache", action="store_true",
                       help="delete the cache and encode everything again")
    train.add_argument("--trust-cache", "--trust_cache", dest="trust_cache", action="store_true",
                       help="use the previous cache manifest without re-reading the dataset files")
    train.add_argument("--cache-only", "--cache_only", dest="cache_only", action="store_true",
                       help="stop after caching")
    train.add_argument("--no-progress", action="store_true", help="no progress bar on the terminal")
    add_train_options(train)
    train.set_defaults(check=lambda args: check_train_args(args, train))   # its usage errors name train's usage
    launch = sub.add_parser("launch", help="start a multi-node run ([cluster] in the config) or one node of it")
    launch.add_argument("config", help="the run config, or <output_dir>/<run>/run.toml to join or resume that run")
    launch.add_argument("--node-rank", type=int, default=None, help="no_ssh: which node this machine is")
    launch.add_argument("--print", action="store_true", dest="print_only", help="print the command(s) and exit")
    launch.add_argument("--resume", action="store_true", help="resume the run from its newest checkpoint")
    sample = sub.add_parser("sample", help="render the [samples] prompts with a LoRA through ComfyUI's sampler")
    sample.add_argument("config")
    sample.add_argument("lora")
    check = sub.add_parser("check-config", help="what each key of a config pair (diffusion-pipe's or ours) means "
                                                "here, the defaults that differ and what is refused, with its fix")
    check.add_argument("config")
    plan = sub.add_parser("memory-plan", help="each pipeline stage's GPU memory under the config's settings, and "
                                              "what memory = 'auto' would choose")
    plan.add_argument("config")
    plan.add_argument("--resolution", type=int, default=None, help="default: the dataset's largest")
    plan.add_argument("--frames", type=int, default=None, help="default: the dataset's largest frame bucket")
    plan.add_argument("--gpu-gib", type=float, default=None, help="plan for a GPU of this size (default: "
                      "memory_limit_gib, else this machine's GPU)")
    doctor = sub.add_parser("doctor", help="ComfyUI, torch/CUDA/DeepSpeed, GPUs and each model type's parity "
                                           "with that ComfyUI's model code")
    doctor.add_argument("--comfyui", action="append", default=None, metavar="PATH",
                        help="check this ComfyUI folder (default: the one a run finds: COMFYUI_PATH, the ComfyUI "
                             "holding custom_nodes/, the pinned copy); given several times, a table of every model "
                             "type's verdict on each")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument("--model-type", action="append", default=None, dest="model_types", metavar="TYPE",
                        help="check only this model type (repeatable)")
    doctor.add_argument("--config", default=None, metavar="RUN_TOML", help="also this run's memory plan on these "
                        "GPUs (as memory-plan prints it)")
    probe = sub.add_parser("comfyui-probe", help="(internal) one ComfyUI's side of the pinned-fallback decision "
                                                 "(backend/parity/probe.py), in a child process")
    probe.add_argument("what", choices=("forward", "lora"))
    probe.add_argument("args", nargs="+")
    ds = sub.add_parser("deepspeed", help="DeepSpeed's launcher (`deepspeed ARGS`), exiting non-zero, with the reason, "
                                          "unless the run finished or was stopped as asked")
    ds.add_argument("args", nargs=argparse.REMAINDER, help="what `deepspeed` takes, e.g. --num_gpus 2 --module "
                    "pipetrain train run.toml")
    for command in (cache, train, launch, sample, check, plan):
        command.add_argument("--comfyui", dest="comfyui_path", default=None, metavar="PATH",
                             help="your ComfyUI folder (default: COMFYUI_PATH, the ComfyUI this package sits in, "
                                  "the one holding this Python's environment or the current folder)")
    demo = sub.add_parser("demo", help="tiny Flux model + generated dataset -> cache -> 2-rank pipeline -> LoRA in ComfyUI")
    demo.add_argument("--workdir", default=None, help="where the demo writes (default .work/demo in the repo)")
    demo.add_argument("--ranks", type=int, default=2)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["deepspeed"] and argv[1:2] not in (["-h"], ["--help"]):   # DeepSpeed's options, not ours
        from .process.deepspeed_cli import main as deepspeed_main
        return deepspeed_main(argv[1:])
    args = _parser().parse_args(argv)
    if hasattr(args, "check"):
        args.check(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        say_comfyui(args)
        if args.command == "doctor":
            from .commands.doctor import main as doctor_main
            if args.comfyui and len(args.comfyui) > 1:
                from .commands.doctor import matrix_main
                return matrix_main(args.comfyui, args.json, args.model_types)
            return doctor_main(args.comfyui[0] if args.comfyui else None, args.json, args.model_types, args.config)
        if args.command == "check-config":
            from .commands.check_config import main as check_main
            return check_main(args.config)
        if args.command == "memory-plan":
            from .memory.cli import main as plan_main
            return plan_main(args.config, args.resolution, args.frames, args.gpu_gib)
        if args.command == "demo":
            from .commands.demo import run_demo
            return run_demo(args.workdir, args.ranks)
        if args.command == "sample":
            from .sampling.render import main as sample_main
            return sample_main(args.config, args.lora)
        if args.command == "comfyui-probe":
            from .parity.probe import probe_main
            return probe_main(args.what, args.args)
        if args.command == "launch":
            from .commands.launch import launch_cluster
            return launch_cluster(args.config, args.node_rank, args.print_only, args.resume)
        from .config import load_run_config
        from .parity.fallback import select_comfyui
        from .preflight import check_run
        from .host.runtime import ensure_comfyui
        from .train import distributed
        from .train.trainer import Trainer, TrainOptions

        cfg = load_run_config(args.config)
        # the host's ComfyUI, or the pinned copy where the host's code moved: chosen before any ComfyUI import,
        # then the architecture's own checks run against the one chosen
        select_comfyui(cfg.model.type)
        check_run(cfg)
        ensure_comfyui()
        # torch's, DeepSpeed's and ComfyUI's modules live as long as this process: frozen, every full collection
        # after (the cache's, each time it drops a VAE or text encoders; Python's own) skips their hundreds of
        # thousands of objects instead of walking them again
        gc.freeze()
        if args.command == "cache":
            opts = TrainOptions(regenerate_cache=args.regenerate_cache, cache_only=True)
        else:
            opts = TrainOptions(resume=args.resume, regenerate_cache=args.regenerate_cache,
                                trust_cache=args.trust_cache, cache_only=args.cache_only,
                                progress=not args.no_progress, reset_dataloader=args.reset_dataloader,
                                reset_optimizer=args.reset_optimizer,
                                reset_optimizer_params=args.reset_optimizer_params)
        code = Trainer(cfg, opts).run()
        if code == 0 and distributed.started():
            distributed.end_process(code)   # a finished rank: see end_process for why not the usual exit
        return code
    except PipeTrainError as e:
        print(f"pipetrain: error: {e}", file=sys.stderr)
        return OUT_OF_SPACE_EXIT if isinstance(e, OutOfSpace) else 2


# the commands that run ComfyUI's code in this process
USES_COMFYUI = {"cache", "train", "sample", "memory-plan", "doctor"}


def say_comfyui(args) -> None:
    """``--comfyui`` taken, and one line on stderr saying which ComfyUI the command uses and how it was found (by
    rank 0 alone; none where none is found: the command says so itself, or needs none)."""
    from .host import runtime
    from .errors import RuntimeSetupError

    if getattr(args, "comfyui_path", None):
        runtime.use_comfyui(args.comfyui_path)
    doctor_paths = args.comfyui if args.command == "doctor" else None
    if args.command not in USES_COMFYUI or doctor_paths or os.environ.get("RANK", "0") != "0":
        return
    try:
        print(f"pipetrain: {runtime.found_comfyui()}", file=sys.stderr)
    except RuntimeSetupError:
        pass


if __name__ == "__main__":
    raise SystemExit(main())
