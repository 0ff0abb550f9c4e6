"""Building the DeepSpeed pipeline engine around an adapter's layers with LoRA attached."""
from __future__ import annotations

import logging

import deepspeed
import torch

from .. import lora
from ..models.base import DTYPES
from .feed import MicroBatchFeed
from .pipeline import StagedModule, stage_bounds
from .schedule import lr_multiplier

log = logging.getLogger("pipetrain")


def make_optimizer(cfg):
    o = cfg.optimizer

    def build(params):
        if o.type.lower() == "sgd":
            return torch.optim.SGD(params, lr=o.lr, weight_decay=o.weight_decay)
        return torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay, eps=o.eps)
    return build


def ds_config(cfg) -> dict:
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size_per_gpu,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "gradient_clipping": cfg.gradient_clipping,
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }


def attach_lora(trainer) -> list[str]:
    a = trainer.cfg.adapter
    dtype = DTYPES[a.dtype] if a.dtype else torch.float32
    spec = lora.LoRASpec(rank=a.rank, alpha=a.alpha if a.alpha is not None else float(a.rank),
                         dropout=a.dropout, dtype=dtype, seed=trainer.cfg.seed)
    names = lora.inject(trainer.adapter.diffusion_model, spec, trainer.adapter.lora_block_prefixes, a.target_modules)
    if a.init_from_existing:
        sd = lora.read_file(trainer.cfg.resolve(a.init_from_existing))
        matched = lora.load_into(trainer.adapter.diffusion_model, sd)
        log.info("init_from_existing: %d of %d adapted modules loaded", matched, len(names))
    return names


def build_engine(trainer) -> None:
    cfg, adapter = trainer.cfg, trainer.adapter
    adapter.load_diffusion_model()
    attach_lora(trainer)
    layers = adapter.to_layers(cfg.activation_checkpointing)
    costs = [adapter.layer_cost(layer) for layer in layers]
    module = StagedModule(layers, costs, cfg.pipeline_stages, cfg.partition_method, cfg.partition_split,
                          loss_fn=adapter.loss)
    trainer.plan = trainer_plan(trainer)  # needs the data-parallel degree, known from the topology
    total_steps = trainer.plan.steps_per_epoch() * cfg.epochs
    if cfg.max_steps:
        total_steps = min(total_steps, cfg.max_steps)
    trainer.total_steps = total_steps
    params = [p for p in module.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(
        model=module, model_parameters=params, optimizer=make_optimizer(cfg),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
            opt, lr_multiplier(cfg.lr_scheduler, cfg.warmup_steps, total_steps)),
        config=ds_config(cfg))
    trainer.engine = engine
    trainer.feed = MicroBatchFeed(adapter, trainer.store, cfg.seed, trainer.dp_rank, trainer.dp_world)
    if trainer.rank == 0:
        bounds = stage_bounds(costs, cfg.pipeline_stages) if cfg.partition_method == "compute" else None
        trainer.reporter.event("engine", layers=len(layers), stage_bounds=bounds, trainable_params=sum(
            p.numel() for p in params), steps_per_epoch=trainer.plan.steps_per_epoch(), total_steps=total_steps)


def trainer_plan(trainer):
    from ..data import EpochPlan

    cfg = trainer.cfg
    dp_world = trainer.world // cfg.pipeline_stages
    stage_rank_size = dp_world  # DeepSpeed's grid: rank = stage * dp_world + dp_rank
    trainer.dp_world = dp_world
    trainer.dp_rank = trainer.rank % stage_rank_size
    plan = EpochPlan(trainer.entries, [e.num_repeats for e in trainer.entries], cfg.micro_batch_size_per_gpu,
                     cfg.gradient_accumulation_steps, trainer.dp_rank, dp_world, cfg.seed)
    if trainer.rank == 0:
        for message in plan.warnings():
            trainer.reporter.event("warning", message=message)
            log.warning(message)
    return plan
