"""Building the DeepSpeed pipeline engine around an adapter's layers with LoRA attached."""
from __future__ import annotations

import logging

import deepspeed
import torch

from ..adapters import injection
from ..adapters import ADAPTERS
from ..config import RunConfig
from ..errors import ConfigError
from ..models.checkpointing import apply_checkpointing, selective_advice
from ..models.losses import Loss
from ..models import fp8
from ..models.compiling import cuda_graphs_allowed
from ..models.flux import diffusers_lora_parts, is_diffusers_lora
from ..models.registry import dp_facts
from ..optim.registry import make_optimizer
from .patches_deepspeed import clear_trained_grads_only, clip_gradients_with, skip_single_rank_allreduce
from . import distributed
from .clipping import clip_grad_norm_
from .ema import WeightAverage
from .eval import build_eval_sets, every_n_steps
from .events import RunReporter
from .feed import MicroBatchFeed
from .parts import CachedData, EngineParts, GradNorm, Topology
from .pipeline import StagedModule
from .preservation import PreservationLoss
from .reg_loss import SplitLoss, StepSums
from .schedule import make_scheduler
from .swap import enable_block_swap

log = logging.getLogger("pipetrain")


def ds_config(cfg) -> dict:
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size_per_gpu,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "gradient_clipping": cfg.gradient_clipping,
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }


def attach_lora(cfg: RunConfig, diffusion_model, block_prefixes, reporter: RunReporter) -> list[str]:
    """The ``[adapter]`` on the model; without one, a full fine-tune (``saving.full_finetune``)."""
    a = cfg.adapter
    if a is None:
        from .saving import full_finetune
        full_finetune(diffusion_model, cfg.file)
        return []
    names = injection.inject_configured(cfg, diffusion_model, block_prefixes)
    if a.init_from_existing:
        load_existing(cfg, diffusion_model, names, reporter)
    return names


def load_existing(cfg: RunConfig, diffusion_model, names: list[str], reporter: RunReporter) -> None:
    """``[adapter] init_from_existing``: a LoRA file, or a folder holding one ``.safetensors`` (what diffusion-pipe
    saves and reads): ComfyUI keys for the same model and rank, or diffusion-pipe's Diffusers-named Flux save
    (``flux_from_diffusers``)."""
    where = dict(file=cfg.file, key="adapter.init_from_existing")
    path = cfg.resolve(cfg.adapter.init_from_existing)
    if path.is_dir():   # diffusion-pipe's rule: the folder's one .safetensors
        found = sorted(path.glob("*.safetensors"))
        if len(found) != 1:
            raise ConfigError(f"{path} holds {len(found)} .safetensors files; name the LoRA file, or a folder "
                              "holding just one (a diffusion-pipe save folder)", **where)
        path = found[0]
    sd = injection.read_file(path)
    rank = cfg.adapter.rank
    if cfg.model.type in dp_facts("dp_diffusers_lora") and cfg.adapter.type == "lora" and is_diffusers_lora(sd):
        sd = flux_from_diffusers(diffusion_model, sd, path, where)
    ranks = {tuple(v.shape)[0] for k, v in sd.items() if k.endswith(".lora_A.weight")}
    if ranks and ranks != {rank}:
        raise ConfigError(f"{path} has LoRA rank {sorted(ranks)}, the config rank {rank}; set [adapter] rank to "
                          "match", **where)
    try:
        matched = injection.load_into(diffusion_model, sd)
    except ValueError as e:   # a LoKr of another rank or decompose_factor
        raise ConfigError(f"{path}: {e}", **where) from None
    if matched == 0:
        part = ADAPTERS[cfg.adapter.type].marker
        raise ConfigError(f"no tensor of {path} matches this model's adapted modules (expected keys like "
                          f"'diffusion_model.{names[0]}.{part}'): a LoRA of another model or key format",
                          **where)
    reporter.event("init_from_existing", path=str(path), modules_loaded=matched, modules=len(names))  # rank 0's
    log.info("init_from_existing: %d of %d adapted modules loaded from %s", matched, len(names), path)


def flux_from_diffusers(diffusion_model, sd: dict, path, where: dict) -> dict:
    """diffusion-pipe's Diffusers-named Flux LoRA as this run's adapter tensors (ComfyUI keys, the run's rank): each
    ComfyUI module's parts (``flux.diffusers_lora_parts``) in the first rows of its rank, the rest of its A as
    initialised and its B zero, B divided by the run's scale (alpha / rank): the module's update is the file's,
    exactly. A fused module needs a rank of its parts' ranks added up (3x for qkv, 4x for a single block's linear1)."""
    modules = {m.lora_name: m for m in injection.adapted_modules(diffusion_model)}
    try:
        parts = diffusers_lora_parts(sd, diffusion_model)
    except ValueError as e:
        raise ConfigError(f"{path}: {e}", **where) from None
    out, short = {}, {}
    for name, (a, b) in parts.items():
        m = modules.get(name)
        if m is None:
            raise ConfigError(f"{path} trains {name}, which this run's adapter leaves out (exclude_modules, "
                              "target_modules); adapt it too, or start from another LoRA", **where)
        rank = m.lora_A.weight.shape[0]
        if a.shape[0] > rank:
            short[name] = a.shape[0]
            continue
        a_init = m.lora_A.weight.detach().to("cpu", torch.float32)
        out[f"{injection.KEY_PREFIX}{name}.lora_A.weight"] = torch.cat([a.float(), a_init[a.shape[0]:]])
        out[f"{injection.KEY_PREFIX}{name}.lora_B.weight"] = torch.cat(
            [b.float() / m.lora_scale, torch.zeros(b.shape[0], rank - a.shape[0])], dim=1)
    if short:
        need = max(short.values())
        raise ConfigError(f"{path} is diffusion-pipe's Diffusers-named Flux LoRA: ComfyUI's Flux fuses its q, k, v "
                          f"(and a single block's MLP input) into one linear, whose LoRA holds the parts exactly at "
                          f"rank {need} ({len(short)} modules need more than this run's rank); set [adapter] rank = "
                          f"{need}", **where)
    return out


def build_engine(cfg: RunConfig, adapter, topology: Topology, data: CachedData,
                 reporter: RunReporter) -> EngineParts:
    """Load the diffusion model, attach the adapter, cut the layers into this rank's pipeline stage and wrap
    them in a DeepSpeed engine with the optimizer and schedule."""
    if cfg.fp8_compute:   # before minutes of loading
        fp8.check_device(distributed.device(), cfg.file)
    adapter.load_diffusion_model()
    attach_lora(cfg, adapter.diffusion_model, adapter.lora_block_prefixes, reporter)
    layers = adapter.to_layers()
    checkpointed = apply_checkpointing(layers, cfg.activation_checkpointing, cfg.activation_checkpointing_fraction)
    advice = selective_advice(cfg.activation_checkpointing, cfg.compile and adapter.compiles_checkpoints)
    if advice and topology.is_main:
        reporter.event("warning", message=advice)
        log.warning(advice)
    if cfg.compile:
        adapter.compile(layers, memory_budget=cfg.activation_memory_budget, cuda_graphs=cuda_graphs_allowed(cfg))
    costs = [adapter.layer_cost(layer) for layer in layers]
    adapter.use_loss(Loss.from_config(cfg))
    loss_fn, loss_sums = training_loss(cfg, adapter, data)
    module = StagedModule(layers, costs, cfg.pipeline_stages, cfg.partition_method, cfg.partition_split,
                          loss_fn=loss_fn)
    swapper = enable_block_swap(module, cfg.blocks_to_swap, distributed.device(), cfg.file)
    swapped = distributed.all_gather_object(len(swapper.slots) if swapper else 0)
    plan = plan_epochs(cfg, data.entries, topology, reporter)
    total_steps = plan.steps_per_epoch() * cfg.epochs
    if cfg.max_steps:
        total_steps = min(total_steps, cfg.max_steps)
    params = [p for p in module.parameters() if p.requires_grad]
    global_batch = plan.global_batch
    engine, _, _, _ = deepspeed.initialize(
        model=module, model_parameters=params, optimizer=make_optimizer(cfg, global_batch),
        lr_scheduler=make_scheduler(cfg, total_steps),
        config=ds_config(cfg))
    if cfg.fp8_compute:   # on this stage's layers, now on its GPU; compile traces them at the first step
        converted = fp8.convert(engine.module)
        log.info("fp8_compute: %d frozen base linears multiply in FP8", converted)
    if adapter.memory_format != torch.contiguous_format:   # after initialize: DeepSpeed views weights as bytes
        engine.module.to(memory_format=adapter.memory_format)
    if engine.dp_world_size == 1:
        skip_single_rank_allreduce(engine)
    clear_trained_grads_only(engine, params)
    grad_norm = record_grad_norm(engine, params, cfg.gradient_clipping)
    feed = MicroBatchFeed(adapter, data.store, cfg.seed, topology.dp_rank, topology.dp_world, data.uncond_text,
                          cfg.uncond_fraction, distributed.device(), reg_labels=any(e.is_reg for e in data.entries),
                          noise_offset=cfg.noise_offset, masks=any(e.mask for e in data.entries),
                          preservation_text=data.preservation_text if cfg.diff_output_preservation else None)
    parts = EngineParts(
        engine=engine, plan=plan, feed=feed, swapper=swapper, grad_norm=grad_norm, global_batch=global_batch,
        total_steps=total_steps,
        save_every_steps=every_n_steps(cfg.save_every_n_steps, cfg.save_every_n_examples, global_batch),
        eval_every_steps=every_n_steps(cfg.eval_every_n_steps, cfg.eval_every_n_examples, global_batch),
        eval_sets=build_eval_sets(cfg, adapter, data, topology, reporter),
        ema=WeightAverage(engine.module, cfg.average_decay) if cfg.ema else None,   # the weights as they start
        loss_sums=loss_sums, preservation=cfg.diff_output_preservation)
    if topology.is_main:
        reporter.event(
            "engine", layers=len(layers), checkpointed_layers=checkpointed, stage_bounds=[int(b) for b in module.parts],
            trainable_params=sum(p.numel() for p in params), steps_per_epoch=plan.steps_per_epoch(),
            total_steps=total_steps, blocks_swapped=swapped[::topology.dp_world])
    return parts


def training_loss(cfg: RunConfig, adapter, data: CachedData):
    """The last stage's loss function, and the step's loss sums it keeps (None: only the loss): each kind's loss
    apart with is_reg directories (``SplitLoss``), and diff_output_preservation's added (``PreservationLoss``)."""
    reg = any(e.is_reg for e in data.entries)
    if not (reg or cfg.diff_output_preservation):
        return adapter.loss, None
    sums = StepSums()
    loss_fn = SplitLoss(adapter.loss, sums) if reg else adapter.loss
    if cfg.diff_output_preservation:
        loss_fn = PreservationLoss(loss_fn, adapter.preservation_loss, cfg.preservation_multiplier, sums)
    return loss_fn, sums


def record_grad_norm(engine, params: list[torch.Tensor], gradient_clipping: float) -> GradNorm:
    """Clip with ``clipping.clip_grad_norm_`` where DeepSpeed clips, keeping the global gradient norm (before
    clipping) for the step event; with gradient_clipping = 0 nothing is clipped and no norm is computed."""
    norm = GradNorm()
    if gradient_clipping <= 0:
        return norm

    def clip_and_record():
        # a device tensor, read when the step is reported: no host sync before the optimizer
        norm.value = clip_grad_norm_(params, engine.gradient_clipping(), engine.mpu)
    clip_gradients_with(engine, clip_and_record)
    return norm


def plan_epochs(cfg: RunConfig, entries, topology: Topology, reporter: RunReporter):
    """This rank's share of every epoch's batches (needs the data-parallel degree, known from the topology)."""
    from ..data import EpochPlan
    from ..data.epoch_plan import batches_by_resolution

    plan = EpochPlan(entries, [e.num_repeats for e in entries], cfg.micro_batch_size_per_gpu,
                     cfg.gradient_accumulation_steps, topology.dp_rank, topology.dp_world, cfg.seed,
                     image_micro_batch_size=cfg.image_micro_batch_size_per_gpu, reg=[e.is_reg for e in entries],
                     reg_ratio=cfg.dataset_config.reg_ratio, by_resolution=batches_by_resolution(cfg),
                     subsample_ratio=cfg.dataset_config.subsample_ratio)
    if topology.is_main:
        for message in plan.warnings():
            reporter.event("warning", message=message)
            log.warning(message)
    return plan
