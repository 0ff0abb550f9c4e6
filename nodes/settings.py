# SPDX-License-Identifier: GPL-3.0-or-later
"""Small setting nodes whose outputs feed Train: Adapter, Optimizer, Schedule, Parallelism, Memory."""
from __future__ import annotations

from comfy_api.latest import io

from ..backend.config.patch import RunPatch
from ..backend.errors import PipeTrainError
from ..launcher.forms import (FULL_FINETUNE, adapter_patch, checkpointing_mode, loss_patch, memory_patch,
                              preservation_patch, unset_if_zero)
from . import types as t
from .declared import CheckedNode
from .widgets import choices, start, words
from .parallelism import batch_list_inputs, parse_batches


ADAPTER_TYPES = (*choices("adapter.type"), FULL_FINETUNE)   # full: no [adapter] table, every weight trains
DEFAULT = "default"   # a dtype combo's "unset": the config's own default applies


def lora_options() -> list[str]:
    import folder_paths
    return folder_paths.get_filename_list("loras")


def lora_path(name: str | None) -> str | None:
    """A LoRA picked from models/loras as its full path (the combo lists only those files)."""
    if name in (None, "", "none"):
        return None
    import folder_paths
    return folder_paths.get_full_path_or_raise("loras", name)


class AdapterNode(CheckedNode):
    # the widgets shown; the rest folded as advanced
    SHOWN = ("type", "rank", "alpha", "dropout", "target_modules", "dtype", "save_dtype", "init_from_existing")

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="PipeTrainAdapter", display_name="PipeTrain LoRA Adapter", category=t.CATEGORY,
            inputs=[
                io.Int.Input("rank", default=start("adapter.rank"), min=1, max=1000000,
                             tooltip="LoRA rank: capacity of the adapter "
                             "(LoKr: the rank of its second Kronecker factor; a huge rank such as 1000000 makes "
                             "it a full matrix; OFT: the largest block size)"),
                io.Float.Input("alpha", default=start("adapter.alpha"), min=0.0, max=4096.0, step=1.0,
                               tooltip="LoRA alpha; the update "
                               "is scaled by alpha/rank. 0 means alpha = rank (scale 1); OFT: its constraint, 0 none"),
                io.Float.Input("dropout", default=start("adapter.dropout"), min=0.0, max=0.99, step=0.01,
                               tooltip="Dropout on the LoRA "
                               "input during training"),
                io.String.Input("target_modules", default=start("adapter.target_modules", off=""),
                                tooltip="Comma-separated module name patterns to adapt; "
                                "empty: the model's default attention and MLP layers"),
                io.Combo.Input("type", options=list(ADAPTER_TYPES), default=start("adapter.type"), optional=True,
                               tooltip="lora; lokr (LyCORIS Kronecker product); loha (LyCORIS Hadamard product); "
                               "oft (orthogonal fine-tuning: rank bounds its block size, alpha is its constraint, 0 "
                               "none), each saved with the keys ComfyUI's LoRA loader reads; or full: no adapter, "
                               "every weight of the diffusion model trains and each epoch saves a whole model "
                               "(<run>/models); needs far more memory: see docs/config.md, Full fine-tune"),
                io.Int.Input("decompose_factor", default=start("adapter.decompose_factor"), min=-1, max=65536,
                             optional=True, tooltip="LoKr: size of the first Kronecker factor's sides (-1: as square "
                             "as possible)"),
                io.Boolean.Input("dora", default=start("adapter.dora"), optional=True,
                                 tooltip="lora: weight-decomposed LoRA (DoRA), a trained magnitude per input column "
                                 "saved as ComfyUI's dora_scale"),
                io.Combo.Input("dtype", options=[DEFAULT, *choices("adapter.dtype")], default=DEFAULT, optional=True,
                               tooltip="The adapter's weight dtype while training (default: float32)"),
                io.Combo.Input("init_from_existing", options=["none", *lora_options()], default="none",
                               optional=True, tooltip="Start from this LoRA in models/loras instead of a fresh one "
                               "(its rank and modules must match)"),
                io.Combo.Input("save_dtype", options=[DEFAULT, *choices("save_dtype")], default=DEFAULT,
                               optional=True, tooltip="The dtype the saved LoRAs (or models) are written in "
                               "(default: as trained)"),
                io.Boolean.Input("ema", default=start("ema"), optional=True, tooltip="Also keep an exponential "
                                 "moving average of the trained weights and save it beside each LoRA (or model) as "
                                 "<name>-ema, loaded like the plain one: often smoother results"),
                io.Float.Input("ema_decay", default=start("ema_decay"), min=0.5, max=0.99999, step=0.0001,
                               round=1e-5, optional=True, tooltip="With ema: the share of the average each step "
                               "keeps; it follows about the last 1 / (1 - decay) steps (0.999: 1000)"),
                io.Boolean.Input("diff_output_preservation", default=start("diff_output_preservation"), optional=True,
                                 tooltip="Differential output preservation (ai-toolkit's): for each caption with the "
                                 "trigger word swapped for the class, the trained model should predict what the base "
                                 "model does, so the class keeps its look; each step computes three rows per sample"),
                io.String.Input("trigger_word", default=start("trigger_word", off=""), optional=True,
                                tooltip="With diff_output_preservation: the word your captions name the subject with "
                                "(e.g. sks)"),
                io.String.Input("diff_output_preservation_class", default=start("diff_output_preservation_class"),
                                optional=True, tooltip="With diff_output_preservation: what replaces the trigger word "
                                "(the subject's class, e.g. person, dog)"),
                io.Float.Input("diff_output_preservation_multiplier",
                               default=start("diff_output_preservation_multiplier"), min=0.0, max=100.0, step=0.05,
                               optional=True, tooltip="With diff_output_preservation: the weight of its loss against "
                               "the training loss"),
                io.String.Input("exclude_modules", default="", optional=True,
                                tooltip="Comma-separated modules left without an adapter: whole module paths or "
                                "their last dotted parts (diffusion-pipe's exclude_modules); empty: none"),
            ],
            outputs=[t.Adapter.Output(display_name="adapter")],
        )

    @classmethod
    def validate_inputs(cls, type=None, decompose_factor=None, dora=None, dropout=None,  # noqa: A002
                        diff_output_preservation=None, trigger_word=None):
        if diff_output_preservation and type == FULL_FINETUNE:
            return ("diff_output_preservation's target is the model without its adapter, and full has none: pick an "
                    "adapter type, or turn diff_output_preservation off")
        if diff_output_preservation and not (trigger_word or "").strip():
            return "diff_output_preservation: give trigger_word, the word your captions name the subject with"
        if dora and type not in (None, "lora"):
            return "dora decomposes a LoRA: set type to lora, or turn dora off"
        if dropout and type == "oft":
            return "OFT rotates the layer's output and has no adapter input to drop: set dropout to 0"
        if decompose_factor == 0:
            return "decompose_factor: give 1 or more, or -1 (as square as possible)"
        if decompose_factor not in (None, -1) and type not in (None, "lokr"):
            return "decompose_factor is a LoKr option: set type to lokr, or decompose_factor to -1"
        return True

    @classmethod
    def execute(cls, rank, alpha, dropout, target_modules, type=start("adapter.type"),  # noqa: A002
                decompose_factor=start("adapter.decompose_factor"), dora=start("adapter.dora"), dtype=DEFAULT,
                init_from_existing="none", save_dtype=DEFAULT, ema=start("ema"),
                ema_decay=start("ema_decay"), exclude_modules="", **preservation) -> io.NodeOutput:
        # dora off leaves the key out (its default), so other types' tables carry no LoRA-only key
        patch = adapter_patch(dict(type=type, rank=rank, alpha=alpha, dropout=dropout, dora=dora or None,
                                   target_modules=words(target_modules), decompose_factor=decompose_factor,
                                   exclude_modules=words(exclude_modules or "") or None,
                                   dtype=None if dtype == DEFAULT else dtype,
                                   init_from_existing=lora_path(init_from_existing)))
        run = {"save_dtype": None if save_dtype == DEFAULT else save_dtype, "ema": ema or None,
               "ema_decay": ema_decay if ema else None}   # off: both keys left out
        return io.NodeOutput(patch | RunPatch.of(run) | preservation_patch(**preservation))


OPTIMIZERS = [start("optimizer.type"), "adamw8bit", "AdamW8bitKahan", "adamw_optimi", "stableadamw", "sgd", "automagic",
              "Prodigy", "CAME",
              "ADOPT",
              "ScheduleFreeAdamW", "Lion"]
NO_BETAS = {"sgd"}
BETA2_ONLY = {"automagic"}   # Adafactor-style second moment only; its eps is its own (1e-30, 1e-3) pair


def _hashable(value):
    if isinstance(value, dict):
        raise ValueError("nested tables are not optimizer arguments")
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value


def parse_kwargs(text: str) -> tuple[tuple[str, object], ...]:
    """``d_coef = 2, decouple = true`` (or one ``key = value`` a line, TOML values) -> sorted (key, value) pairs."""
    import tomllib
    text = (text or "").strip()
    if not text:
        return ()
    try:
        table = tomllib.loads(f"t = {{{text}}}")["t"] if "\n" not in text else tomllib.loads(text)
        return tuple(sorted((k, _hashable(v)) for k, v in table.items()))
    except (tomllib.TOMLDecodeError, ValueError) as e:
        raise ValueError(f"extra_args {text!r}: write key = value pairs with TOML values separated by commas or "
                         f"lines, e.g. d_coef = 2, decouple = true ({e})") from None


class OptimizerNode(CheckedNode):
    SHOWN = ("type", "lr", "beta1", "beta2", "weight_decay", "eps", "gradient_clipping")   # the rest folded as advanced

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="PipeTrainOptimizer", display_name="PipeTrain Optimizer", category=t.CATEGORY,
            inputs=[
                io.Combo.Input("type", options=OPTIMIZERS, default=start("optimizer.type"),
                               tooltip="Optimizer algorithm: adamw "
                               "(torch), adamw8bit (bitsandbytes), AdamW8bitKahan (8-bit AdamW with Kahan-compensated "
                               "bfloat16 weights: a full fine-tune or bfloat16 adapters), adamw_optimi / stableadamw "
                               "(torch-optimi), sgd, automagic (diffusion-pipe's per-element learning rates; "
                               "min_lr, max_lr, lr_bump in extra_args), or a pytorch_optimizer class (Prodigy: set lr 1)"),
                io.Float.Input("lr", default=start("optimizer.lr"), min=1e-8, max=1.0, step=1e-5, round=1e-8,
                               tooltip="Peak learning rate"),
                io.Float.Input("beta1", default=start("optimizer.betas")[0], min=0.0, max=0.9999, step=0.001,
                               tooltip="Adam beta1 (momentum)"),
                io.Float.Input("beta2", default=start("optimizer.betas")[1], min=0.0, max=0.99999, step=0.001,
                               tooltip="Adam beta2"),
                io.Float.Input("weight_decay", default=start("optimizer.weight_decay"), min=0.0, max=1.0, step=0.001,
                               tooltip="Decoupled weight "
                               "decay"),
                io.Float.Input("eps", default=start("optimizer.eps"), min=1e-12, max=1e-3, step=1e-9, round=1e-12,
                               tooltip="Adam epsilon"),
                io.String.Input("extra_args", default="", multiline=True, tooltip="More constructor arguments of the "
                                "optimizer as TOML key = value pairs, e.g. d_coef = 2, decouple = true (Prodigy) or "
                                "momentum = 0.9 (sgd); checked against the optimizer when queued"),
                io.Float.Input("beta2_half_life", default=start("optimizer.beta2_half_life", off=0.0), min=0.0, max=1e9,
                               step=1.0, optional=True, tooltip="Sets beta2 = 0.5 ** (global batch / half-life), in "
                               "examples (0: off, beta2 as given)"),
                io.Float.Input("gradient_clipping", default=start("gradient_clipping"), min=0.0, max=1e6, step=0.1,
                               optional=True, tooltip="Clip the gradients' global norm to this (0: no clipping)"),
                io.Combo.Input("loss_type", options=choices("loss_type"), default=start("loss_type"), optional=True,
                               tooltip="Loss between the prediction and the model's own target: mse (the usual), "
                               "l1, huber or smooth_l1 (less pull from outliers)"),
                io.Float.Input("huber_delta", default=start("huber_delta"), min=1e-4, max=100.0, step=0.01,
                               optional=True, tooltip="loss_type huber: quadratic below this error, linear above"),
                io.Float.Input("smooth_l1_beta", default=start("smooth_l1_beta"), min=1e-4, max=100.0, step=0.01,
                               optional=True, tooltip="loss_type smooth_l1: quadratic below this error, linear above"),
                io.Float.Input("noise_offset", default=start("noise_offset"), min=0.0, max=1.0, step=0.01,
                               optional=True, tooltip="Add this times a random per-channel shift to the noise "
                               "(ai-toolkit's noise offset: darker darks, brighter brights; 0: off, 0.05-0.1 usual)"),
            ],
            outputs=[t.Optimizer.Output(display_name="optimizer")],
        )

    @classmethod
    def validate_inputs(cls, extra_args=None):
        try:
            parse_kwargs(extra_args or "")
        except ValueError as e:
            return str(e)
        return True

    @classmethod
    def defaults(cls) -> RunPatch:
        """The node as it starts (what Train uses without an Optimizer node)."""
        return cls.execute(start("optimizer.type"), start("optimizer.lr"), *start("optimizer.betas"),
                           start("optimizer.weight_decay"), start("optimizer.eps")).result[0]

    @classmethod
    def execute(cls, type, lr, beta1, beta2, weight_decay, eps, extra_args="",  # noqa: A002
                beta2_half_life=0.0,
                gradient_clipping=start("gradient_clipping"), **loss) -> io.NodeOutput:
        betas = {"betas": (beta1, beta2), "eps": eps} if type not in NO_BETAS | BETA2_ONLY else {}
        betas = {"beta2": beta2} if type in BETA2_ONLY else betas
        keys = {"type": type, "lr": lr, "weight_decay": weight_decay, **betas, **dict(parse_kwargs(extra_args)),
                "beta2_half_life": unset_if_zero(beta2_half_life)}
        # loss_type, huber_delta, smooth_l1_beta, noise_offset: run keys (launcher/forms.loss_patch)
        return io.NodeOutput(RunPatch.of(keys, "optimizer") | RunPatch.of({"gradient_clipping": gradient_clipping})
                             | loss_patch(**loss))


class ScheduleNode(CheckedNode):
    SHOWN = ("epochs", "lr_scheduler", "warmup_steps", "save_every_n_epochs", "checkpoint_every_n_minutes", "seed",
             "max_steps", "eval_every_n_epochs")   # the rest folded as advanced

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="PipeTrainSchedule", display_name="PipeTrain Schedule", category=t.CATEGORY,
            inputs=[
                io.Int.Input("epochs", default=start("epochs"), min=1, max=100000, tooltip="Passes over the dataset"),
                io.Combo.Input("lr_scheduler", options=choices("lr_scheduler"), default=start("lr_scheduler"),
                               tooltip="Learning-rate curve after warm-up"),
                io.Int.Input("warmup_steps", default=start("warmup_steps"), min=0, max=1000000,
                             tooltip="Steps of linear LR warm-up"),
                io.Int.Input("save_every_n_epochs", default=start("save_every_n_epochs"), min=0, max=10000,
                             tooltip="Write an epoch LoRA into models/loras/pipetrain/<run> every N epochs (0: none, "
                             "with save_every_n_steps set)"),
                io.Int.Input("checkpoint_every_n_epochs", default=start("checkpoint_every_n_epochs"), min=0,
                             max=10000, tooltip="Save a resumable checkpoint every N epochs (0: off)"),
                io.Float.Input("checkpoint_every_n_minutes", default=start("checkpoint_every_n_minutes", off=0.0),
                               min=0.0, max=10000.0, step=1.0, tooltip="Save a resumable checkpoint every N minutes "
                               "(0: off)"),
                io.Int.Input("seed", default=start("seed"), min=0, max=2**31 - 1, tooltip="Random seed of the run"),
                io.Int.Input("save_every_n_steps", default=start("save_every_n_steps"), min=0, max=10000000,
                             tooltip="Also write a step LoRA every N optimizer steps (0: off)"),
                io.Int.Input("eval_every_n_epochs", default=start("eval_every_n_epochs"), min=0, max=10000,
                             tooltip="With an eval dataset on Train: held-out loss at the end of every N-th epoch "
                             "(0: off)"),
                io.Int.Input("eval_every_n_steps", default=start("eval_every_n_steps"), min=0, max=10000000,
                             tooltip="With an eval dataset on Train: held-out loss every N steps (0: off)"),
                *(io.Int.Input(key, default=start(key), min=0, max=10**9, optional=True, tooltip=tip)
                  for key, tip in COUNTS),
                io.Boolean.Input("eval_before_first_step", default=start("eval_before_first_step"), optional=True,
                                 tooltip="With an eval dataset: a held-out loss before training starts"),
                io.Int.Input("eval_micro_batch_size_per_gpu", default=start("eval_micro_batch_size_per_gpu"), min=0,
                             max=256, optional=True, tooltip="Eval micro batch (0: the training one)"),
                io.Int.Input("eval_gradient_accumulation_steps", default=start("eval_gradient_accumulation_steps"),
                             min=1, max=1024, optional=True, tooltip="Eval micro batches per eval step"),
                io.Int.Input("steps_per_print", default=start("steps_per_print"), min=1, max=100000, optional=True,
                             tooltip="DeepSpeed prints its step log every N steps"),
                io.Combo.Input("run_layout", options=choices("run_layout"), default=start("run_layout"),
                               optional=True, tooltip="diffusion-pipe: each save also as <run>/epochN/"
                               "adapter_model.safetensors and each checkpoint as <run>/global_stepN, where "
                               "diffusion-pipe's scripts look"),
                io.Int.Input("eval_image_micro_batch_size_per_gpu",
                             default=start("eval_image_micro_batch_size_per_gpu"), min=0, max=256, optional=True, tooltip="Video models: the eval micro batch of images "
                             "(0: the eval micro batch)"),
                *batch_list_inputs("eval_"),
                io.Boolean.Input("enable_wandb", default=False, optional=True, tooltip="Also log the run's "
                                 "scalars to Weights & Biases (needs wandb installed and logged in on this machine: "
                                 "`wandb login`); TensorBoard logs either way"),
                io.String.Input("wandb_tracker_name", default="", optional=True, tooltip="With enable_wandb: the W&B "
                                "project (empty: pipetrain)"),
                io.String.Input("wandb_run_name", default="", optional=True, tooltip="With enable_wandb: the W&B run "
                                "name (empty: the run id)"),
                io.Float.Input("force_constant_lr", default=0.0, min=0.0, max=1.0, step=1e-6, round=1e-8,
                               optional=True, tooltip="diffusion-pipe's force_constant_lr: every parameter group "
                               "at this learning rate, constant (no warm-up), a resumed run too (0: off, the "
                               "schedule above)"),
            ],
            outputs=[t.Schedule.Output(display_name="schedule")],
        )

    @classmethod
    def validate_inputs(cls, save_every_n_epochs=None, save_every_n_steps=None, save_every_n_examples=None,
                        eval_micro_batch_size_by_resolution=None, eval_image_micro_batch_size_by_resolution=None):
        if save_every_n_epochs == 0 and save_every_n_steps == 0 and not save_every_n_examples:
            return "nothing would be saved: set save_every_n_epochs or save_every_n_steps"
        try:
            parse_batches(eval_micro_batch_size_by_resolution or "", "eval_micro_batch_size_by_resolution")
            parse_batches(eval_image_micro_batch_size_by_resolution or "", "eval_image_micro_batch_size_by_resolution")
        except ValueError as e:
            return str(e)
        return True

    @classmethod
    def execute(cls, enable_wandb=False, wandb_tracker_name="", wandb_run_name="", **keys) -> io.NodeOutput:
        # the widgets are the run keys; 0 leaves an optional one out (its default: off)
        counts = {k: unset_if_zero(v) for k, v in keys.items() if k in UNSET_BY_ZERO}
        lists = {k: parse_batches(v, k) for k, v in keys.items() if k.endswith("_by_resolution")}
        # the API key is never a widget (a workflow file would carry it): wandb's own login holds it
        monitoring = {"monitoring": {"enable_wandb": True, "wandb_tracker_name": wandb_tracker_name.strip() or None,
                                     "wandb_run_name": wandb_run_name.strip() or None}} if enable_wandb else {}
        return io.NodeOutput(RunPatch.of({**keys, **counts, **lists, **monitoring}))


# optional counts whose 0 means "off" (the key left out)
COUNTS = (("max_steps", "Stop after this many optimizer steps (0: after the epochs)"),
          ("save_every_n_examples", "Also write a LoRA every N training examples (0: off)"),
          ("eval_every_n_examples", "With an eval dataset: held-out loss every N training examples (0: off)"))
UNSET_BY_ZERO = {"force_constant_lr", "save_every_n_epochs", "checkpoint_every_n_epochs", "checkpoint_every_n_minutes",
                 "save_every_n_steps", "eval_every_n_epochs", "eval_every_n_steps", "eval_micro_batch_size_per_gpu",
                 "eval_image_micro_batch_size_per_gpu", *(k for k, _ in COUNTS)}


class MemoryNode(CheckedNode):
    # the widgets shown; the rest folded as advanced
    SHOWN = ("memory", "memory_limit_gib", "activation_checkpointing", "blocks_to_swap", "compile", "fp8_compute")

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="PipeTrainMemory", display_name="PipeTrain Memory", category=t.CATEGORY,
            inputs=[
                io.Boolean.Input("activation_checkpointing", default=bool(start("activation_checkpointing")),
                                 tooltip="Recompute activations in the "
                                 "backward pass: much less memory, slower steps (docs/benchmarks.md)"),
                io.Int.Input("blocks_to_swap", default=start("blocks_to_swap"), min=0, max=200,
                             tooltip="Per pipeline stage: this many "
                             "transformer blocks keep their frozen weights in CPU memory and are copied to the "
                             "GPU just before use (0: off). Less GPU memory, slower steps; fewer than a stage's "
                             "blocks; adapters only (not a full fine-tune)"),
                io.Boolean.Input("offload_activations", default=False, tooltip="With activation checkpointing: keep "
                                 "each block's saved inputs in CPU memory too (diffusion-pipe's 'unsloth'; a little "
                                 "less GPU memory, a little slower)"),
                io.Boolean.Input("compile", default=start("compile"), optional=True,
                                 tooltip="torch.compile each transformer "
                                 "block: faster steps on a GPU (docs/benchmarks.md), the first step waits for the "
                                 "compile"),
                io.Float.Input("checkpoint_fraction", default=start("activation_checkpointing_fraction"), min=0.05,
                               max=1.0, step=0.05, optional=True,
                               tooltip="With activation checkpointing: the share of blocks checkpointed, evenly "
                               "spread (1: all). Lower is faster and takes more memory; pick the lowest that fits"),
                io.Float.Input("memory_budget", default=start("activation_memory_budget", off=1.0), min=0.0, max=1.0,
                               step=0.05, optional=True,
                               tooltip="With compile: the share of each block's activations kept for the backward "
                               "pass; torch.compile recomputes the rest, cheapest ops first (1: keep all). An "
                               "alternative to checkpointing whole blocks"),
                io.Boolean.Input("selective", default=False, optional=True, tooltip="With activation "
                                 "checkpointing: keep the attention and MLP down-projection outputs, recompute the "
                                 "rest: faster than recomputing whole blocks for a little more memory where the GPU "
                                 "paces the step (Flux compiled). Needs compile to pay: uncompiled, and on SDXL, "
                                 "its per-operation policy made steps slower (docs/benchmarks.md). Not with "
                                 "offload_activations"),
                io.Boolean.Input("fp8_compute", default=start("fp8_compute"), optional=True,
                                 tooltip="The frozen base weights "
                                 "multiply in FP8 (each turned to FP8 once, at the start), the LoRA in its own "
                                 "dtype: faster steps and half the base weights' memory on Hopper and newer GPUs, "
                                 "refused elsewhere. Not with "
                                 "blocks_to_swap"),
                io.Boolean.Input("compile_cuda_graphs", default=start("compile_cuda_graphs"), optional=True,
                                 tooltip="With compile: replay compiled regions as CUDA graphs where that pays "
                                 "(SDXL); off: plain compiled kernels"),
                io.Combo.Input("memory", options=["manual", "auto"], default=start("memory"), optional=True,
                               tooltip="auto: before training, the run estimates each pipeline stage's GPU memory "
                               "from the model itself and picks the fastest checkpointing and block swapping that "
                               "fit (the choices above are then ignored); the run's events say what it chose"),
                io.Float.Input("memory_limit_gib", default=0.0, min=0.0, max=4096.0, step=1.0, optional=True,
                               tooltip="With memory = auto: plan for this many GiB of each GPU (a GPU shared with "
                               "ComfyUI or another job); 0: the whole GPU"),
            ],
            outputs=[t.Memory.Output(display_name="memory")],
        )

    @classmethod
    def validate_inputs(cls, offload_activations=None, selective=None):
        try:
            checkpointing_mode(True, bool(offload_activations), bool(selective))
        except PipeTrainError as e:
            return str(e)
        return True

    @classmethod
    def execute(cls, activation_checkpointing, blocks_to_swap, offload_activations=False, memory_limit_gib=0.0,
                **keys) -> io.NodeOutput:
        return io.NodeOutput(memory_patch(activation_checkpointing, offload_activations, blocks_to_swap=blocks_to_swap,
                                          memory_limit_gib=unset_if_zero(memory_limit_gib), **keys))
