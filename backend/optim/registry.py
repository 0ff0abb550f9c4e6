"""Optimizers by name, as diffusion-pipe names them; every ``[optimizer]`` key but ``type`` goes to the
constructor, so any option the class takes can be set from the config.

| type (any case)  | class                                   | package            |
|------------------|-----------------------------------------|--------------------|
| adamw            | torch.optim.AdamW                       | torch              |
| sgd              | torch.optim.SGD                         | torch              |
| adamw8bit        | bitsandbytes.optim.AdamW8bit            | bitsandbytes       |
| AdamW8bitKahan   | kahan.AdamW8bitKahan (see below)        | bitsandbytes       |
| adamw_optimi     | optimi.AdamW (Kahan summation for bf16) | torch-optimi       |
| stableadamw      | optimi.StableAdamW                      | torch-optimi       |
| automagic        | automagic.Automagic (per-element learning rates)       | torch |
| anything else    | that class of pytorch_optimizer (Prodigy, CAME, ADOPT, ...) | pytorch-optimizer |

``pytorch_optimizer`` is diffusion-pipe's own fallback, so a diffusion-pipe config naming one of its
classes (``type = 'Prodigy'``) means the same here; it is maintained (monthly releases), pure Python, and
its Prodigy is the reference algorithm with the same arguments as ``prodigyopt``.

``AdamW8bitKahan`` (diffusion-pipe's class of that name, for bfloat16 weights, e.g. a full fine-tune): no
maintained library ships 8-bit states together with Kahan summation (torchao's ``AdamW8bit`` rounds bf16
updates stochastically and needs torch.compile; torch-optimi's and pytorch_optimizer's ``kahan_sum`` keep
32-bit states), so ``optim/kahan.py`` adds the Kahan buffer to bitsandbytes' ``AdamW8bit`` (already a
dependency; diffusion-pipe subclasses it too), whose 8-bit kernels run on GPUs and on the CPU.

torch's ``adamw`` and ``sgd`` run their fused CUDA kernels when every parameter is on a GPU and the config sets
neither ``fused`` nor ``foreach``: one pass over each parameter instead of a dozen foreach launches per op
(a measurable share of a LoRA step on a GPU, docs/config.md).
"""
from __future__ import annotations

import importlib
import inspect

from ..errors import ConfigError

BUILTIN = {
    "adamw": ("torch.optim", "AdamW"),
    "sgd": ("torch.optim", "SGD"),
    "adamw8bit": ("bitsandbytes.optim", "AdamW8bit"),
    "adamw8bitkahan": (f"{__package__}.kahan", "AdamW8bitKahan"),
    "adamw_optimi": ("optimi", "AdamW"),
    "stableadamw": ("optimi", "StableAdamW"),
    "automagic": (f"{__package__}.automagic", "Automagic"),
}
PIP_NAMES = {"bitsandbytes": "bitsandbytes", "optimi": "torch-optimi", "pytorch_optimizer": "pytorch-optimizer"}


def _where(cfg):
    return getattr(cfg, "file", None)


def _import(module: str, cfg):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = (e.name or module).split(".")[0]
        package = PIP_NAMES.get(top, top)
        raise ConfigError(f"optimizer {cfg.optimizer.type!r} needs the Python package {package} ({e}); install it "
                          f"with `pip install {package}`", file=_where(cfg), key="optimizer.type") from None


def optimizer_class(cfg):
    name = cfg.optimizer.type
    module, attr = BUILTIN.get(name.lower(), ("pytorch_optimizer", name))
    mod = _import(module, cfg)
    klass = getattr(mod, attr, None)
    if klass is None and module == "pytorch_optimizer":
        try:
            klass = mod.load_optimizer(name)   # case-insensitive lookup of its registry
        except Exception:  # noqa: BLE001  (it raises NotImplementedError for unknown names)
            klass = None
    if not _is_optimizer_class(klass):    # any other name of the module (a function, a loss) is never called
        raise ConfigError(f"got {name!r}: not a known optimizer; use one of {', '.join(BUILTIN)} or a class of "
                          "pytorch_optimizer (e.g. 'Prodigy', 'CAME', 'ADOPT')", file=_where(cfg), key="optimizer.type")
    return klass


def _is_optimizer_class(klass) -> bool:
    import torch

    return inspect.isclass(klass) and issubclass(klass, torch.optim.Optimizer)


def _check_kwargs(klass, kwargs: dict, cfg) -> None:
    sig = inspect.signature(klass.__init__)
    params = list(sig.parameters.values())[2:]   # self, params
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in kwargs:
        if key not in names and not takes_any:
            raise ConfigError(f"{klass.__name__} takes no argument {key!r}; it takes: {', '.join(names)}",
                              file=_where(cfg), key=f"optimizer.{key}")
    for p in params:
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in kwargs:
            raise ConfigError(f"{klass.__name__} needs {p.name!r}; set it in [optimizer]", file=_where(cfg),
                              key=f"optimizer.{p.name}")


def _configured_kwargs(cfg) -> dict:
    """``[optimizer]``'s constructor arguments; a UNet model's ``unet_lr`` is its ``lr`` (the UNet is all that
    trains)."""
    kwargs = cfg.optimizer.kwargs()
    if getattr(cfg.model, "unet_lr", None) is not None:
        kwargs["lr"] = cfg.model.unet_lr
    return kwargs


def resolve_optimizer(cfg):
    """(class, constructor kwargs) for the run, checked against the constructor's signature."""
    klass = optimizer_class(cfg)
    kwargs = _configured_kwargs(cfg)
    _check_kwargs(klass, kwargs, cfg)
    return klass, kwargs


def optimizer_kwargs(cfg, global_batch_size: int) -> dict:
    kwargs = _configured_kwargs(cfg)
    half_life = cfg.optimizer.beta2_half_life
    if half_life:   # diffusion-pipe: beta2 from a half-life in samples
        kwargs["betas"] = (kwargs["betas"][0], 0.5 ** (global_batch_size / half_life))
    return kwargs


def make_optimizer(cfg, global_batch_size: int):
    """A builder for ``deepspeed.initialize(optimizer=...)``: params -> the configured optimizer."""
    klass, _ = resolve_optimizer(cfg)
    kwargs = optimizer_kwargs(cfg, global_batch_size)

    def build(params):
        params = decay_groups(list(params))
        return klass(params, **kwargs, **fused_default(klass, kwargs, params))
    return build


def decay_groups(params: list) -> list[dict]:
    """diffusion-pipe's parameter groups: biases, norm scales and every other one-dimensional parameter without
    weight decay (``weight_decay = 0`` in their group), the rest with the optimizer's. Only a full fine-tune has
    such parameters: every adapter's are matrices."""
    decayed = [p for p in params if p.ndim > 1]
    plain = [p for p in params if p.ndim <= 1]
    return [g for g in ({"params": decayed}, {"params": plain, "weight_decay": 0.0}) if g["params"]]


def fused_default(klass, kwargs: dict, params: list) -> dict:
    """``fused=True`` for torch's AdamW and SGD on GPU parameters unless the config chose ``fused`` or ``foreach``."""
    import torch

    if klass not in (torch.optim.AdamW, torch.optim.SGD) or {"fused", "foreach"} & kwargs.keys():
        return {}
    tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    return {"fused": True} if tensors and all(p.device.type == "cuda" for p in tensors) else {}


def prodigy_d(optimizer) -> float | None:
    """Prodigy's adapted step size d (the mean over parameter groups), None for other optimizers."""
    groups = getattr(optimizer, "param_groups", [])
    ds = [g["d"] for g in groups if "d" in g]
    return sum(ds) / len(ds) if ds else None
