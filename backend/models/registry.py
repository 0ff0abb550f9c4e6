"""Model type string -> adapter class. Adding a model is one line here plus its module (``base.py`` lists what the
module declares); the shared modules ask this registry for the declared facts instead of keeping tables by type."""
from __future__ import annotations

import importlib

# type string -> "module:Class", the module relative to this package (imported lazily so only the chosen model's
# code loads; relative because ComfyUI imports a custom node under a module name made of its folder's path)
ADAPTERS: dict[str, str] = {
    "flux": ".flux:FluxAdapter",
    "sdxl": ".sdxl:SDXLAdapter",
    "sd15": ".sd15:SD15Adapter",
    "sd2": ".sd15:SD2Adapter",
    "sd3": ".sd3:SD3Adapter",
    "chroma": ".chroma:ChromaAdapter",
    "wan": ".wan:WanAdapter",
    "flux2": ".flux2:Flux2Adapter",
    "flux_kontext": ".flux_kontext:FluxKontextAdapter",
    "flux2_edit": ".flux2_edit:Flux2EditAdapter",
    "flux2_klein": ".flux2_klein:Flux2KleinAdapter",
    "hunyuan_video": ".hunyuan_video:HunyuanAdapter",
    "hunyuan_video_15": ".hunyuan_video:HunyuanVideo15Adapter",
    "hunyuan_image_21": ".hunyuan_video:HunyuanImage21Adapter",
    "wan_i2v": ".wan:WanI2VAdapter",
    "wan_flf2v": ".wan:WanFLF2VAdapter",
    "wan_vace": ".wan_control:WanVaceAdapter",
    "wan_fun_control": ".wan_control:WanFunControlAdapter",
    "wan22_5b": ".wan22:Wan22Adapter",
    "wan22_5b_i2v": ".wan22:Wan22I2VAdapter",
    "qwen_image": ".qwen_image:QwenImageAdapter",
    "qwen_image_edit": ".qwen_image:QwenImageEditAdapter",
    "qwen_image_edit_plus": ".qwen_image:QwenImageEditPlusAdapter",
    "ltx_video": ".ltx_video:LTXVideoAdapter",
    "ltx_video_i2v": ".ltx_video:LTXVideoI2VAdapter",
    "cosmos_predict2": ".cosmos:CosmosPredict2Adapter",
    "cosmos": ".cosmos1:Cosmos1Adapter",
    "auraflow": ".auraflow:AuraFlowAdapter",
    "hidream": ".hidream:HiDreamAdapter",
    "omnigen2": ".omnigen2:OmniGen2Adapter",
    "z_image": ".lumina:ZImageAdapter",
    "lumina2": ".lumina:Lumina2Adapter",
    "ace_step": ".ace_step:AceStepAdapter",
    "anima": ".anima:AnimaAdapter",
    "ernie_image": ".ernie_image:ErnieImageAdapter",
}

# Models whose code the pinned ComfyUI (0.3.75) does not have: type string -> (name, the first ComfyUI
# release known to have it, or None when unknown). Once PipeTrain runs on such a ComfyUI, the model's adapter
# module goes into ADAPTERS and its line leaves this table.
NEEDS_NEWER_COMFYUI: dict[str, tuple[str, str | None]] = {
    "ltx2": ("LTX 2.3", None),
    "ideogram4": ("Ideogram 4", None),
    "krea2": ("Krea 2", "0.27.0"),                     # merged 2026-06-22 (Comfy-Org/ComfyUI#14589)
    "minimax_h3": ("MiniMax H3", None),
}


def unavailable_reason(model_type: str, comfyui_version: str | None = None) -> str | None:
    """Why ``model_type`` cannot train here, or None when it can. A type whose code needs a newer ComfyUI than
    ``comfyui_version`` (default: the version of the ComfyUI this process finds, read without importing it) is
    refused naming both versions."""
    from ..host.runtime import PINNED_VERSION

    if model_type in ADAPTERS:
        return too_old_reason(model_type, comfyui_version)
    if model_type in NEEDS_NEWER_COMFYUI:
        name, version = NEEDS_NEWER_COMFYUI[model_type]
        needs = f"ComfyUI {version} or newer" if version else f"a ComfyUI newer than {PINNED_VERSION}"
        return (f"{model_type!r} ({name}) needs model code that ComfyUI {PINNED_VERSION}, which PipeTrain runs on, "
                f"does not have; it is in {needs}. Supported model types: {', '.join(sorted(ADAPTERS))}")
    return f"got {model_type!r}; supported model types: {', '.join(sorted(ADAPTERS))}"


def too_old_reason(model_type: str, comfyui_version: str | None = None) -> str | None:
    """Why a supported ``model_type`` cannot train on the ComfyUI of ``comfyui_version`` (default: the one this
    process finds; none found: None, the run's own search says so), or None."""
    from ..host.versions import TESTED_VERSIONS, parse

    needs = arch_spec(model_type).min_comfyui
    if not needs:
        return None
    if comfyui_version is None:
        from ..errors import RuntimeSetupError
        from ..host.runtime import locate_comfyui
        from ..host.versions import read_version

        try:
            comfyui_version = read_version(locate_comfyui())
        except RuntimeSetupError:
            return None
    found = parse(comfyui_version)
    if found is None or found >= parse(needs):
        return None
    return (f"{model_type!r} ({arch_spec(model_type).title}) needs ComfyUI {needs} or newer, whose model code "
            f"loads it; this ComfyUI is {comfyui_version}. Point COMFYUI_PATH at ComfyUI {needs} or newer (PipeTrain "
            f"is tested with {TESTED_VERSIONS[-1]}), or pick another model type")


def adapter_class(model_type: str):
    """The adapter class of a supported model type, its module imported now. Importing one imports no ComfyUI
    (config validation reads the classes' facts, e.g. in ``pipetrain launch``, where ComfyUI's device probe would hold
    a GPU context through the run); ComfyUI is set up once an adapter is constructed (``ModelAdapter.__init__``) and
    wherever a ComfyUI class is named (``spec.comfy_object``)."""
    try:
        target = ADAPTERS[model_type]
    except KeyError:
        raise KeyError(unavailable_reason(model_type)) from None
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module, __package__), name)


def arch_spec(model_type: str):
    """The ``spec.ArchSpec`` of a supported model type (its files and how ComfyUI recognises them)."""
    return adapter_class(model_type).spec


def types_with(fact: str) -> list[str]:
    """The supported model types whose adapter class sets ``fact`` (e.g. ``vace_inputs``), for messages that must
    name them without the caller spelling a type."""
    return sorted(t for t in ADAPTERS if getattr(adapter_class(t), fact, False))


def arch_specs() -> dict:
    return {name: arch_spec(name) for name in ADAPTERS}


def dp_facts(fact: str) -> dict[str, object]:
    """Supported type -> its value of one of diffusion-pipe's naming facts (``ModelAdapter.dp_*``), for the types
    whose adapter class sets it itself: each names one type, so a subclass (Qwen-Image-Edit-Plus of Qwen-Image-Edit)
    does not inherit its base's."""
    out = {}
    for t in ADAPTERS:
        value = vars(adapter_class(t)).get(fact)
        if value:
            out[t] = value
    return out


def declared_kinds(table: str) -> dict:
    """The text-encoder (``table`` "text_encoder_kinds") or VAE ("vae_kinds") kinds the supported models declare in
    their own ``ArchSpec`` (the ones no other model reads), by kind name."""
    out = {}
    for t in ADAPTERS:
        out.update(getattr(arch_spec(t), table))
    return out
