# SPDX-License-Identifier: GPL-3.0-or-later
"""Every place PipeTrain changes ComfyUI's own code, one named function each: what to audit on a ComfyUI upgrade.

PipeTrain trains with ComfyUI's model code as it is. Where it cannot, the change is made here and nowhere else,
and each function first checks (``patching.require``) that what it replaces exists and takes the arguments the
replacement was written for, so an upgrade that moved it stops with an error naming ComfyUI's version and the
attribute instead of running code that no longer matches. Tests: tests/ranks/test_patches.py.

- ``rebind_forwards``: SDXL's SpatialTransformers and ResBlocks run forwards re-stated for training
  (``models/sdxl.py``: same maths, channels-last kept, norms compilable), per module instance.
- ``mistral_tokenizer_for_transformers5``: ComfyUI 0.3.75's Flux 2 tokenizer loader, replaced process-wide under
  transformers 5 (whose converter and Llama tokenizer changed).
- ``detection_from_config``: while a tiny diffusion-model file loads through ComfyUI's own loader, its detection
  gives the config the file names in its metadata (``models/loading.py``).
- ``text_encoder_kinds``: while tiny text-encoder files load through ComfyUI's text-encoder loading, it takes their
  kinds as given instead of telling them by layers only full-depth files have (``models/loading.py``).
- ``kitchen_eager``: while ComfyUI's training paths are on (``runtime.comfy_training_paths``), the comfy-kitchen
  fused kernels ComfyUI calls on every path (Cosmos Predict2's RMSNorm + RoPE, from 0.8 on) run comfy-kitchen's
  own eager backend, which autograd can differentiate: the fused kernels register no backward.
- ``training_attention_priority``: while ComfyUI's training paths are on, its SDPA backend priority (0.33 puts
  flash attention first on every CUDA machine, for inference) lists cuDNN attention first, the backend torch picks
  itself on Hopper and the faster one for a training step's backward (``bench/attention_backends.py``).
- ``narrowed_class``: while a tiny VAE file is built, the ComfyUI class whose width ComfyUI fixes takes the widths
  the file names in its metadata (``models/loading.py``).
"""
from __future__ import annotations

import contextlib
import functools
import importlib

import torch

from . import patching
from .runtime import comfyui_version, ensure_comfyui

HOST = "ComfyUI"


def _require(owner, name: str, params: tuple | None = None):
    return patching.require(HOST, comfyui_version, owner, name, params)


def rebind_forwards(modules, forwards: dict[type, object], *args) -> int:
    """``module.forward = partial(forwards[type(module)], module, *args)`` for each of ``modules`` (instances of the
    classes ``forwards`` names); each replacement takes the module, ``args`` and then exactly the arguments of the
    class's own ``forward``. Returns how many modules were rebound."""
    for cls, forward in forwards.items():
        _require(cls, "forward", ("self", *patching.replacement_params(forward, 1 + len(args))))
    count = 0
    for module in modules:
        module.forward = functools.partial(forwards[type(module)], module, *args)
        count += 1
    return count


def mistral_tokenizer_for_transformers5() -> bool:
    """Let ComfyUI 0.3.75 build Flux 2's tokenizer under transformers 5; returns whether its loader is ours.

    ComfyUI's ``load_mistral_tokenizer`` hands transformers 4's ``MistralConverter`` the tekken vocabulary
    (``MistralConverter(vocab=...)``), and transformers 4's Llama tokenizer puts ``<s>`` first. transformers 5's
    converter reads a tekken.json file instead and its Llama tokenizer adds no ``<s>``, so ComfyUI's tokenizer
    fails to build. Under transformers 5 this swaps in a loader that writes the tekken bytes to a file for the new
    converter and adds the ``<s>`` (id 1): the same ids, with tekken's own pre-tokenizer pattern, as ComfyUI's
    later releases give. Under transformers 4 it changes nothing, nor on a ComfyUI that reads tekken.json itself
    (``from_tekken_json``, 0.33.0), whose tokenizer object the patched loader's would replace with one it cannot call.
    """
    import inspect

    ensure_comfyui()
    import comfy.text_encoders.flux as comfy_flux
    if hasattr(comfy_flux, "from_tekken_json"):
        return False
    try:
        from transformers.integrations.mistral import MistralConverter
    except ImportError:
        return False
    vocab_file = inspect.signature(MistralConverter.__init__).parameters.get("vocab_file")
    if vocab_file is None or vocab_file.default is not inspect.Parameter.empty:
        return False   # transformers 4: ComfyUI's own loader works
    if getattr(comfy_flux.load_mistral_tokenizer, "pipetrain", False):
        return True
    _require(comfy_flux, "load_mistral_tokenizer", ("data",))
    comfy_flux.load_mistral_tokenizer = _load_mistral_tokenizer
    return True


def _load_mistral_tokenizer(data) -> dict:
    import tempfile
    from pathlib import Path

    from tokenizers import processors
    from transformers.integrations.mistral import MistralConverter

    raw = data.numpy().tobytes() if torch.is_tensor(data) else data
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "tekken.json"
        path.write_bytes(raw if isinstance(raw, bytes) else str(raw).encode())
        tokenizer = MistralConverter(str(path)).converted()
    tokenizer.post_processor = processors.Sequence([
        tokenizer.post_processor, processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])])
    return {"tokenizer_object": tokenizer, "legacy": False}


_load_mistral_tokenizer.pipetrain = True


@contextlib.contextmanager
def narrowed_class(target: str, widths: dict):
    """While inside, ComfyUI's class ``target`` ("module:Class", as its own code looks it up) is built with
    ``widths`` over the constructor arguments it is given: ComfyUI's detection builds some VAEs at a fixed width
    whatever the file holds, and a tiny file names its narrower widths in its metadata."""
    ensure_comfyui()
    module_name, _, name = target.partition(":")
    module = importlib.import_module(module_name)
    cls = _require(module, name)
    setattr(module, name, lambda *args, **kwargs: cls(*args, **{**kwargs, **widths}))
    try:
        yield
    finally:
        setattr(module, name, cls)


@contextlib.contextmanager
def detection_from_config(unet_config: dict, model_config):
    """While inside, ComfyUI's diffusion-model detection gives ``unet_config`` and ``model_config`` (the
    ``comfy.supported_models`` instance built from it) instead of reading them from the weights, so a tiny file
    whose config its weights do not tell (SDXL at a smaller width) loads through ComfyUI's own
    ``comfy.sd.load_diffusion_model``: its fp8 and quantization detection, dtype choice and weight loading run as
    for a real file."""
    ensure_comfyui()
    import comfy.model_detection as detection
    detect = _require(detection, "detect_unet_config", ("state_dict", "key_prefix", "metadata"))
    # 0.33 adds the key prefix (for its matches); the config given is the answer either way
    pick = _require(detection, "model_config_from_unet_config",
                    (("unet_config", "state_dict"), ("unet_config", "state_dict", "unet_key_prefix")))
    detection.detect_unet_config = lambda state_dict, key_prefix, metadata=None: dict(unet_config)
    detection.model_config_from_unet_config = lambda config, state_dict=None, unet_key_prefix="": model_config
    try:
        yield
    finally:
        detection.detect_unet_config, detection.model_config_from_unet_config = detect, pick


@contextlib.contextmanager
def text_encoder_kinds(kinds: dict[int, tuple[str, str]], loaded: dict[int, object]):
    """While inside, ComfyUI's text-encoder loading takes each state dict's kind as given instead of telling it by
    layer keys that only full-depth files have: ``kinds`` maps ``id(state dict)`` to (its ``comfy.sd.TEModel``
    name, the attribute of its encoder in the CLIP's model). ``detect_te_model`` gives that kind, so ComfyUI's own
    dispatch picks the text-encoder classes and tokenizer as for a real file, and ``CLIP.load_sd`` loads the state
    dict into that encoder (ComfyUI's pairs route a file by such keys too); ``loaded`` receives what each load
    returned (missing and unexpected keys), which ComfyUI only logs."""
    ensure_comfyui()
    import comfy.sd
    import comfy.text_encoders.long_clipl as long_clip
    detect = _require(comfy.sd, "detect_te_model", ("sd",))
    load_sd = _require(comfy.sd.CLIP, "load_sd", ("self", "sd", "full_model"))
    long_options = _require(long_clip, "model_options_long_clip", ("sd", "tokenizer_data", "model_options"))

    def long_options_unless_given(sd, tokenizer_data, model_options):
        # ComfyUI's check for 248-token CLIPs replaces a CLIP's config option with its own position count, and
        # names the encoder by layer keys: a given kind keeps the config it came with
        return (tokenizer_data, model_options) if id(sd) in kinds else long_options(sd, tokenizer_data, model_options)

    def detect_given(sd):
        return comfy.sd.TEModel[kinds[id(sd)][0]] if id(sd) in kinds else detect(sd)

    def load_into_given(self, sd, full_model=False):
        if full_model or id(sd) not in kinds:
            return load_sd(self, sd, full_model)
        loaded[id(sd)] = getattr(self.cond_stage_model, kinds[id(sd)][1]).load_sd(sd)
        return loaded[id(sd)]

    comfy.sd.detect_te_model, comfy.sd.CLIP.load_sd = detect_given, load_into_given
    long_clip.model_options_long_clip = long_options_unless_given
    try:
        yield
    finally:
        comfy.sd.detect_te_model, comfy.sd.CLIP.load_sd = detect, load_sd
        long_clip.model_options_long_clip = long_options


@functools.lru_cache(maxsize=1)
def _kitchen_ops_without_backward() -> tuple[str, ...]:
    """The comfy-kitchen ops with an eager implementation whose custom op has no backward registered with torch
    (all of them where torch's registry cannot be read: the eager one is always differentiable)."""
    import comfy_kitchen
    import comfy_kitchen.backends.eager as eager

    try:
        from torch._library.custom_ops import OPDEFS
    except ImportError:
        OPDEFS = None
    names = [n for n in getattr(eager, "__all__", ()) if hasattr(comfy_kitchen, n) and hasattr(eager, n)]
    if OPDEFS is None:
        return tuple(names)
    return tuple(n for n in names
                 if getattr(OPDEFS.get(f"comfy_kitchen::{n}"), "_backward_fn", None) is None)


def _kitchen():
    """comfy-kitchen where this ComfyUI uses it (0.8 on), else None."""
    ensure_comfyui()
    import sys
    try:   # where ComfyUI uses comfy-kitchen, its quant_ops imports it (and ComfyUI reaches it through there)
        importlib.import_module("comfy.quant_ops")
    except ImportError:
        return None
    return sys.modules.get("comfy_kitchen")


def kitchen_in_training() -> list[str]:
    """The comfy-kitchen ops training takes from its eager backend on this ComfyUI ([] where ComfyUI has none)."""
    return list(_kitchen_ops_without_backward()) if _kitchen() is not None else []


def _swap(kitchen, pairs: list[tuple[object, object]]) -> None:
    """Every reference to the first function of a pair, in comfy-kitchen's module and in every ComfyUI module, made
    to the second (0.8 binds ``apply_rope = comfy.quant_ops.ck.apply_rope`` at import; later ones look it up per
    call)."""
    import sys

    by_id = {id(old): (old, new) for old, new in pairs}
    for name, module in list(sys.modules.items()):
        if module is kitchen or module is not None and (name == "comfy" or name.startswith("comfy.")):
            for attr, value in list(vars(module).items()):
                hit = by_id.get(id(value))
                if hit is not None and value is hit[0]:
                    setattr(module, attr, hit[1])


@contextlib.contextmanager
def kitchen_eager():
    """While inside, the comfy-kitchen ops without a backward resolve to comfy-kitchen's eager backend wherever
    ComfyUI's model code reaches them, so a backward through ComfyUI's code works. On the way out every reference
    goes back to the fused op, also in a ComfyUI module imported meanwhile (which bound the eager one)."""
    kitchen = _kitchen()
    routed = kitchen_in_training() if kitchen is not None else []
    if not routed or getattr(kitchen, "_pipetrain_eager", False):
        yield
        return
    import comfy_kitchen.backends.eager as eager
    pairs = [(getattr(kitchen, op), getattr(eager, op)) for op in routed]
    _swap(kitchen, pairs)
    kitchen._pipetrain_eager = True
    try:
        yield
    finally:
        _swap(kitchen, [(new, old) for old, new in pairs])
        kitchen._pipetrain_eager = False


def _training_sdpa_priority() -> list:
    from torch.nn.attention import SDPBackend

    return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@contextlib.contextmanager
def training_attention_priority():
    """While inside, ``comfy.ops.SDPA_BACKEND_PRIORITY`` (which its ``scaled_dot_product_attention`` reads per call,
    where it sets one) is the training order; nothing changes where ComfyUI sets none."""
    ensure_comfyui()
    ops = importlib.import_module("comfy.ops")
    priority = getattr(ops, "SDPA_BACKEND_PRIORITY", None)
    if not isinstance(priority, list):
        yield
        return
    before = list(priority)
    priority[:] = _training_sdpa_priority()
    try:
        yield
    finally:
        priority[:] = before
