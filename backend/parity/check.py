# SPDX-License-Identifier: GPL-3.0-or-later
"""Does PipeTrain's training maths match the host ComfyUI's model code? Checked before a run caches or trains.

PipeTrain's pipeline layers re-state each model's block maths around the host ComfyUI's modules (its forwards
add residuals in place and cannot train). A ComfyUI whose blocks compute something else would crash a run deep
inside a rank or, worse, train a LoRA that does not match what the user generates with. So, for one model type:

- ComfyUI's own model class is built at a small config (random weights, float64, on the CPU) and our layers and
  ComfyUI's inference forward run on the same probe inputs: their outputs must agree to rounding. Where they do
  not, forward hooks on every weight-holding module name the first module whose output differs: where the
  maths diverged.
- The LoRA keys our saver writes for that model go through the host's ``comfy.lora`` key map: every adapted
  module must receive its patch.
- A ComfyUI with training paths (``comfy.model_management.in_training``, 0.8 on) routes RoPE, RMSNorm and adaLN
  through comfy-kitchen's fused kernels at inference, and those refuse float64. There the float64 comparison runs
  against ComfyUI's eager training paths (the same maths, autograd-safe: what our layers call), and a second one in
  float32 against its inference forward with the fused kernels, the forward the user generates with: together they
  show our training maths equal to what ComfyUI computes at inference.

A verdict is memoised per (ComfyUI version, hashes of the ComfyUI and PipeTrain files the check depends on,
model type) so a repeated run pays nothing. ``host/versions.py`` holds the tested ComfyUI range.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..errors import PipeTrainError
from ..fsutil import user_cache_dir

# float64 on both sides: what remains is rounding (and ComfyUI's float32 rotary tables, which both sides share);
# a change in the maths (a scale, an epsilon, a gate) shows orders of magnitude above it
TOLERANCE = {torch.float64: 1e-8, torch.float32: 1e-4}
_MEMO_VERSION = 4   # 4: files named by their paths under ComfyUI's and PipeTrain's folders


class ParityError(PipeTrainError):
    """The host ComfyUI computes something other than PipeTrain's layers for a model type: the run is refused."""

    def __init__(self, result: "ParityResult"):
        super().__init__(result.message())
        self.result = result


@dataclass
class ParityResult:
    model_type: str
    comfyui_version: str
    comfyui_path: str
    verdict: str                       # "passes" | "differs" | "lacks" (the model's code) | "fails" (raised)
    max_difference: float | None = None    # max |ours - ComfyUI's| over the probe output
    scale: float | None = None             # max |ComfyUI's output|
    where: str = ""                        # first module whose output differs, or the exception's origin
    detail: str = ""                       # what differs / what raised, in words
    lora_keys: int = 0                     # adapted modules whose saved keys the host's comfy.lora maps
    lora_keys_unmapped: list[str] = field(default_factory=list)
    lora_difference: float | None = None   # max |ours - ComfyUI's| with a LoRA (merged on ComfyUI's side)
    dtype: str = "float64"                 # the dtype of the comparison (float32 where the host's kernels refuse
    #                                        float64 on every path, or the model type's own parity_dtype)
    kernel_difference: float | None = None  # max |ours - ComfyUI's inference forward| in float32 (fused kernels)
    needs_comfyui: str = ""                 # "lacks": the first ComfyUI release with the model's code, where known
    seconds: float = 0.0
    memoised: bool = False

    @property
    def ok(self) -> bool:
        return self.verdict == "passes"

    def summary(self) -> str:
        """One line for a table cell or a node."""
        if self.ok:
            return f"passes (max difference {self.max_difference:.1e} of {self.scale:.1e}; {self.lora_keys} LoRA keys)"
        if self.verdict == "lacks":
            return f"refused: {self.detail}"
        return f"refused: {self.detail}" + (f" at {self.where}" if self.where else "")

    def message(self) -> str:
        """Why a run is refused and what to do."""
        from ..host.versions import EVERY_TYPE_PASSES_ON, TESTED_RANGE, pinned_hint

        what = {"differs": "computes something other than PipeTrain's training layers",
                "fails": "has model code PipeTrain's training layers cannot run against",
                "lacks": "lacks this model's code"}.get(self.verdict, self.verdict)
        head = (f"model type {self.model_type!r}: ComfyUI {self.comfyui_version} ({self.comfyui_path}) {what}: "
                f"{self.detail}")
        if self.needs_comfyui:   # no older ComfyUI (the pinned one included) trains it; the detail says what to do
            return f"{head}. The run stops before caching."
        if self.where:
            head += f"; it arises at {self.where}"
        return (f"{head}. A LoRA trained here would not match what this ComfyUI generates, so the run stops before "
                f"caching. PipeTrain is tested with ComfyUI {TESTED_RANGE} and every model type passes on "
                f"{EVERY_TYPE_PASSES_ON} (docs/models.md's compatibility table lists the others): point "
                f"COMFYUI_PATH at such a ComfyUI, or {pinned_hint()}; `python -m pipetrain doctor` shows every model "
                f"type's verdict on a ComfyUI.")

    def to_json(self) -> dict:
        return {**asdict(self), "ok": self.ok, "summary": self.summary()}


# --- memo -------------------------------------------------------------------------------------------------------
def _memo_file() -> Path:
    return Path(os.environ.get("PIPETRAIN_PARITY_CACHE") or user_cache_dir()) / "parity.json"


def _hash_files(files, roots=()) -> str:
    """The files' bytes, each named by its path under the first of ``roots`` that holds it (with that root's place
    in ``roots``), else by its whole path: a ComfyUI or a checkout at another path (a CI checkout, a moved install)
    keeps the verdicts of the same code."""
    def name(f: Path) -> str:
        for i, root in enumerate(roots):
            if f.is_relative_to(root):
                return f"{i}:{f.relative_to(root).as_posix()}"
        return str(f)

    h = hashlib.sha256()
    for label, f in sorted((name(f), f) for f in set(files)):
        h.update(label.encode())
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:20]


def _comfy_files(root: Path) -> list[Path]:
    """The ComfyUI files a verdict depends on: its model code (``comfy/ldm``: the model's own package and the
    shared attention, RoPE and norm layers) and what builds the model and maps LoRA keys."""
    comfy = root / "comfy"
    return [*(comfy / "ldm").rglob("*.py"),
            *(comfy / n for n in ("ops.py", "lora.py", "model_base.py", "supported_models.py", "model_sampling.py",
                                  "rmsnorm.py", "latent_formats.py", "model_patcher.py") if (comfy / n).is_file())]


def _own_root() -> Path:
    return Path(__file__).resolve().parents[2]   # the package's folder: backend/ and the rest under it


def _own_files() -> list[Path]:
    backend = Path(__file__).resolve().parents[1]
    return [Path(__file__).resolve(), backend / "adapters" / "injection.py", *(backend / "models").glob("*.py")]


def _memo_key(model_type: str, version: str, root: Path) -> str:
    root = Path(root).resolve()
    return f"v{_MEMO_VERSION}|{model_type}|{version}|{_hash_files(_comfy_files(root) + _own_files(), (root, _own_root()))}"


def _read_memo() -> dict:
    try:
        return json.loads(_memo_file().read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _write_memo(key: str, result: ParityResult) -> None:
    from ..fsutil import atomic_write_json

    memo = _read_memo()
    memo[key] = asdict(result)
    try:
        _memo_file().parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(_memo_file(), memo)
    except OSError:   # a read-only home: the check simply runs again next time
        pass


# --- the check --------------------------------------------------------------------------------------------------
def _leaf_outputs(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], list]:
    """Forward hooks recording the first output of every module that holds its own weights, by name, in call
    order (the dict keeps insertion order)."""
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for name, m in model.named_modules():
        if not any(True for _ in m.parameters(recurse=False)):
            continue

        def hook(mod, args, out, name=name):
            if name not in seen and isinstance(out, torch.Tensor):
                seen[name] = out.detach().clone()
        handles.append(m.register_forward_hook(hook))
    return seen, handles


def _first_difference(ours: dict, ref: dict, tolerance: float) -> str:
    """Where the two runs part: the first module, in ComfyUI's call order, whose output differs. Both runs share
    its weights, so what changed is the computation feeding it (in its block, or the end of the block before)."""
    for name, r in ref.items():
        o = ours.get(name)
        if o is not None and o.shape == r.shape:
            if float((o - r).abs().max()) > tolerance * max(float(r.abs().max()), 1e-30):
                return f"the input of {name} (the first module whose output differs)"
    return ""


def _small_adapter(model_type: str, dtype: torch.dtype | None = None):
    """The model type's adapter in ``dtype`` (default its ``parity_dtype``: float64 unless ComfyUI's code needs
    float32) over ComfyUI's own model class at the ``micro`` config, random weights."""
    import comfy.model_management as mm
    import comfy.model_patcher

    from ..config import ModelConfig
    from ..models import loading
    from ..models.registry import adapter_class

    cls = adapter_class(model_type)
    adapter = cls(ModelConfig(type=model_type, diffusion_model="unused", vae="unused"))
    # getattr: until the registry names adapters relative to this package (issue #25), a ComfyUI that loads
    # PipeTrain as a custom node may take the adapter classes from another installed copy
    adapter.dtype = dtype or getattr(cls, "parity_dtype", torch.float64)
    unet_config = cls.spec.unet_config("micro")
    model_config = loading.model_config(adapter.arch, unet_config)
    model_config.set_inference_dtype(adapter.dtype, None)
    with cls.spec.built_in(unet_config):
        model = model_config.get_model({}, "", device=torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in [*model.diffusion_model.parameters(), *model.diffusion_model.buffers()]:
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g, dtype=t.dtype) * 0.05)
    if adapter.dtype == torch.float64:
        # a float32 attn_precision (SD 2.x's, against fp16 overflow) makes ComfyUI's CPU attention cast float64 q and
        # k down to float32, a 1e-9 difference that is no error of ours; SDPA, which training and ComfyUI on a GPU
        # run, ignores it
        for m in model.diffusion_model.modules():
            if getattr(m, "attn_precision", None) == torch.float32:
                m.attn_precision = None
    adapter.use_model(comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"),
                                                       offload_device=mm.unet_offload_device()))
    return adapter


def _probe(adapter):
    g = torch.Generator().manual_seed(1)
    dtype = adapter.dtype
    x0 = adapter.probe_latent(g).to(dtype)
    noise = torch.randn(x0.shape, generator=g).to(dtype)
    t = torch.tensor([0.6], dtype=dtype)
    text = [x.to(dtype) if x.is_floating_point() else x for x in adapter.probe_text(g)]
    return x0, noise, t, text


def host_has_training_paths() -> bool:
    """Whether the host ComfyUI runs fused inference kernels that training replaces by eager code: its own
    training paths (``in_training``) or comfy-kitchen's eager backend (``patches_comfyui.kitchen_eager``)."""
    import comfy.model_management as mm

    from ..host.patches_comfyui import kitchen_in_training

    return hasattr(mm, "in_training") or bool(kitchen_in_training())


def reference_on_training_paths(adapter) -> bool:
    """Whether ComfyUI's reference forward for ``adapter`` runs its eager training paths: in float64 on a host whose
    inference kernels refuse float64 (the float32 comparison covers the kernels)."""
    return adapter.dtype == torch.float64 and host_has_training_paths()


def _compare_forward(adapter, result: ParityResult, reference_training: bool = False) -> None:
    """ComfyUI's forward as the user generates with it (``reference_training``: its eager training paths) against
    our layers as they train."""
    from ..host.runtime import comfy_training_paths

    x0, noise, t, text = _probe(adapter)
    dm = adapter.diffusion_model
    theirs, handles = _leaf_outputs(dm)
    try:
        with torch.no_grad(), comfy_training_paths(reference_training):
            ref = adapter.reference_forward(adapter.objective().noisy(x0, noise, t), t, text)
    finally:
        for h in handles:
            h.remove()
    mine, handles = _leaf_outputs(dm)
    try:
        ours = _run_layers(adapter, (x0, noise, t, *text))
    finally:
        for h in handles:
            h.remove()
    if ours.shape != ref.shape:
        result.verdict = "differs"
        result.detail = f"output shapes differ: ours {tuple(ours.shape)}, ComfyUI's {tuple(ref.shape)}"
        return
    tolerance = TOLERANCE[adapter.dtype]
    result.max_difference = float((ours - ref).abs().max())
    result.scale = float(ref.abs().max())
    if not result.max_difference <= tolerance * max(result.scale, 1e-30):
        result.verdict = "differs"
        result.detail = (f"largest difference {result.max_difference:.3g} on outputs as large as {result.scale:.3g} "
                         f"(rounding allows {tolerance:g} of it)")
        result.where = _first_difference(mine, theirs, tolerance) or "the model's output layer"


def _run_layers(adapter, inputs) -> torch.Tensor:
    """Our pipeline layers, one after the other, with ComfyUI's training code paths (no autograd)."""
    from ..host.runtime import comfy_training_paths

    h = inputs
    with torch.no_grad(), comfy_training_paths(True):
        for layer in adapter.to_layers():
            h = layer(h)
    return h


def _forward_with_merged_lora(adapter, patches: dict, modules: list, probe) -> torch.Tensor:
    """ComfyUI's forward with the LoRA merged into its weights by its own ``ModelPatcher.add_patches`` and
    ``comfy.lora.calculate_weight`` (what LoraLoaderModelOnly's patcher does on load), in the weights' dtype; our
    hooks are silenced meanwhile and every weight is restored after."""
    import comfy.lora

    from ..host.runtime import comfy_training_paths

    x0, noise, t, text = probe
    merged = adapter.patcher.clone()
    merged.add_patches(patches, 1.0)
    params = dict(adapter.patcher.model.named_parameters())
    saved, scales = {}, [m.lora_scale for m in modules]
    try:
        with torch.no_grad():
            for key, plist in merged.patches.items():
                weight = params[key]
                saved[key] = weight.detach().clone()
                weight.copy_(comfy.lora.calculate_weight(plist, weight.detach().clone(), key,
                                                         intermediate_dtype=weight.dtype))
            for m in modules:   # ComfyUI's side carries the LoRA in its weights, not in our hooks
                m.lora_scale = 0.0
            with comfy_training_paths(reference_on_training_paths(adapter)):
                return adapter.reference_forward(adapter.objective().noisy(x0, noise, t), t, text)
    finally:
        with torch.no_grad():
            for key, w in saved.items():
                params[key].copy_(w)
        for m, scale in zip(modules, scales):
            m.lora_scale = scale


def _compare_with_lora(adapter, result: ParityResult) -> None:
    """A LoRA on every module PipeTrain adapts: every saved key is mapped by the host's ``comfy.lora``, and
    ComfyUI's forward with that LoRA merged into its weights (as ``LoraLoaderModelOnly`` does) equals our layers
    with the LoRA as they train it (forward hooks on ComfyUI's linears, which a fused kernel would bypass)."""
    import comfy.lora

    from ..adapters import injection

    dm = adapter.diffusion_model
    spec = injection.AdapterSpec(rank=2, alpha=2.0, dtype=adapter.dtype)
    names = injection.inject(dm, spec, adapter.lora_block_prefixes)
    g = torch.Generator().manual_seed(2)
    modules = list(injection.adapted_modules(dm))
    for m in modules:
        m.lora_B.weight.data.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.05)
    sd = injection.state_dict(dm)
    key_map = comfy.lora.model_lora_keys_unet(adapter.patcher.model, {})
    patches = comfy.lora.load_lora(sd, key_map, log_missing=False)
    patched = {k[0] if isinstance(k, tuple) else k for k in patches}
    unmapped = [n for n in names if f"{injection.KEY_PREFIX}{n}.weight" not in patched]
    result.lora_keys = len(names) - len(unmapped)
    result.lora_keys_unmapped = unmapped
    if unmapped:
        result.verdict = "differs"
        result.detail = (f"{len(unmapped)} of the {len(names)} modules a LoRA adapts are not mapped by this "
                         f"ComfyUI's comfy.lora (its LoraLoader would drop them)")
        result.where = unmapped[0]
        return

    x0, noise, t, text = _probe(adapter)
    ours = _run_layers(adapter, (x0, noise, t, *text))
    ref = _forward_with_merged_lora(adapter, patches, modules, (x0, noise, t, text))
    difference = float((ours - ref).abs().max())
    if difference > TOLERANCE[adapter.dtype] * max(float(ref.abs().max()), 1e-30):
        result.verdict = "differs"
        result.detail = (f"with a LoRA, ComfyUI's forward (LoRA merged by comfy.lora) and the training layers "
                         f"differ by {difference:.3g} on outputs as large as {float(ref.abs().max()):.3g}: a "
                         f"module may bypass the linear layers PipeTrain's LoRA hooks")
    result.lora_difference = difference
    if result.ok:
        _check_gradients(adapter, modules, (x0, noise, t, *text), result)


def _check_gradients(adapter, modules: list, inputs, result: ParityResult) -> None:
    """A backward through our layers reaches every LoRA tensor (a ComfyUI kernel without a backward, or one that
    detaches, would leave some without a gradient or raise)."""
    from ..host.runtime import comfy_training_paths

    h = inputs
    with torch.enable_grad(), comfy_training_paths(True):
        for layer in adapter.to_layers():
            h = layer(h)
        h.float().square().mean().backward()
    starved = [m.lora_name for m in modules
               if any(p.grad is None or not bool(p.grad.abs().sum() > 0) or not bool(torch.isfinite(p.grad).all())
                      for p in (m.lora_A.weight, m.lora_B.weight))]
    for m in modules:
        m.lora_A.weight.grad = m.lora_B.weight.grad = None
    if starved:
        result.verdict = "differs"
        result.detail = (f"no usable gradient reaches the LoRA of {len(starved)} of {len(modules)} modules: this "
                         f"ComfyUI's code on that path has no backward")
        result.where = starved[0]


def _check_both_paths(model_type: str, result: ParityResult) -> None:
    """The comparisons of the module docstring: float64 (against the training paths where the host has them),
    LoRA and gradients; then, on a host with inference kernels, float32 against its inference forward."""
    adapter = _small_adapter(model_type)
    result.dtype = str(adapter.dtype).removeprefix("torch.")
    kernels = reference_on_training_paths(adapter)
    try:
        _compare_forward(adapter, result, reference_training=kernels)
    except Exception as e:  # noqa: BLE001
        if not _refuses_float64(e):
            raise
        # the host calls a fused kernel on every path of this model (no eager float64 code to compare with): the
        # whole check runs in float32, the kernel's backward included
        adapter, kernels = _small_adapter(model_type, torch.float32), False
        result.dtype = "float32"
        _compare_forward(adapter, result)
    if result.ok:
        _compare_with_lora(adapter, result)
    if not (result.ok and kernels):
        return
    at_float32 = ParityResult(model_type, result.comfyui_version, result.comfyui_path, verdict="passes")
    _compare_forward(_small_adapter(model_type, torch.float32), at_float32)
    result.kernel_difference = at_float32.max_difference
    if not at_float32.ok:
        result.verdict, result.where = at_float32.verdict, at_float32.where
        result.detail = f"with its inference kernels (float32), {at_float32.detail}"


def _refuses_float64(e: BaseException) -> bool:
    """A comfy-kitchen kernel's refusal of float64 inputs (it names no backend for the dtype)."""
    return type(e).__name__ == "NoCapableBackendError" and "float64" in str(e)


def _origin(e: BaseException, comfy_root: Path) -> str:
    """The innermost frame of the exception in ComfyUI's or PipeTrain's code (not torch's), as file:line."""
    import traceback

    own = Path(__file__).resolve().parents[2]
    frames = traceback.extract_tb(e.__traceback__)
    ours = [f for f in frames if Path(f.filename).resolve().is_relative_to(own)
            or Path(f.filename).resolve().is_relative_to(comfy_root)]
    f = (ours or frames or [None])[-1]
    if f is None:
        return ""
    path = Path(f.filename).resolve()
    for base in (comfy_root, own):
        if path.is_relative_to(base):
            path = path.relative_to(base)
            break
    return f"{path}:{f.lineno} ({f.name})"


def check_model_type(model_type: str, *, use_memo: bool = True) -> ParityResult:
    """The parity verdict of ``model_type`` on the ComfyUI this process imports (``runtime.ensure_comfyui``)."""
    from ..models.registry import ADAPTERS, adapter_class, too_old_reason, unavailable_reason
    from ..host.runtime import comfyui_version, ensure_comfyui

    root = ensure_comfyui()
    version = comfyui_version()
    result = ParityResult(model_type, version, str(root), verdict="passes")
    if model_type not in ADAPTERS:
        result.verdict, result.detail = "lacks", unavailable_reason(model_type)
        return result
    key = _memo_key(model_type, version, root) if use_memo else ""
    if use_memo:
        hit = _read_memo().get(key)
        if hit:
            return ParityResult(**{**hit, "comfyui_path": str(root), "memoised": True})
    start = time.perf_counter()
    try:
        # a model sharing a ComfyUI class an older ComfyUI has (Flux 2 Klein's Flux2) is too new for it by release
        too_old = too_old_reason(model_type, version)
        missing = "" if too_old else missing_comfy_code(model_type)
        if too_old:
            result.verdict, result.detail = "lacks", too_old
            result.needs_comfyui = adapter_class(model_type).spec.min_comfyui
        elif missing:
            result.verdict = "lacks"
            result.detail = f"this ComfyUI has no {missing} (the model's code arrived in a later ComfyUI)"
        else:
            # autograd on whatever the caller does (ComfyUI runs nodes under inference mode, whose tensors
            # cannot take part in a backward)
            with torch.inference_mode(False), torch.enable_grad():
                _check_both_paths(model_type, result)
    except Exception as e:  # noqa: BLE001  (an API that moved: the verdict names it)
        result.verdict = "fails"
        result.detail = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        result.where = _origin(e, root.resolve())
    result.seconds = round(time.perf_counter() - start, 3)
    if use_memo and result.verdict != "fails":   # an exception may be passing (memory, a file being replaced)
        _write_memo(key, result)
    return result


def missing_comfy_code(model_type: str) -> str:
    """What of the model's ComfyUI code this ComfyUI lacks ("" when nothing): its ``comfy.supported_models``
    classes."""
    import comfy.supported_models as sm

    from ..models.registry import arch_spec

    spec = arch_spec(model_type)
    absent = [n for n in spec.comfy_configs if not hasattr(sm, n)]
    if len(absent) == len(spec.comfy_configs):
        return f"comfy.supported_models.{absent[0]}"
    return ""


def check_run(model_type: str, reporter=None) -> ParityResult:
    """The check a run makes before caching: reports the verdict (events and status) and raises
    ``ParityError`` on a mismatch."""
    from ..host.versions import comfyui_info

    result = check_model_type(model_type)
    if reporter is not None:
        reporter.event("parity", **result.to_json())
        reporter.update(comfyui={**comfyui_info(), "parity": result.to_json()})
    if not result.ok:
        raise ParityError(result)
    return result
