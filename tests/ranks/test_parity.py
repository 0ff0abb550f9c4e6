"""The parity check a run makes before caching (backend/parity/check.py): on the pinned ComfyUI every model type
passes; a ComfyUI whose block maths differs by one line refuses the run, naming what and where, before any
cache is written; verdicts are memoised."""
import os
import subprocess
import sys
import time

import pytest
from comfyui_copies import comfyui_cache, doctor, other_comfyuis, planted_copy, python_env
from conftest import train

from pipetrain.backend.parity import check as parity
from pipetrain.backend.models.registry import ADAPTERS, adapter_class
from pipetrain.backend.host.runtime import PINNED_COMFYUI, PINNED_VERSION, ensure_comfyui

# ComfyUI's Flux double block adds its image MLP through the modulation gate: a 1 % larger gate is the kind of
# change an upstream release could make (and the kind a LoRA trained on the old maths would not survive)
FLUX_BLOCK = "comfy/ldm/flux/layers.py"
GATE_LINE = "img_mod2.gate, None, modulation_dims_img)"
PLANTED = "img_mod2.gate * 1.01, None, modulation_dims_img)"


@pytest.fixture
def memo(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPETRAIN_PARITY_CACHE", str(tmp_path / "memo"))
    return tmp_path / "memo" / "parity.json"


@pytest.fixture(scope="module")
def pinned_verdicts(tmp_path_factory):
    """The memo of the pinned ComfyUI's verdicts, taken by the first test from an empty memo; the doctor's child
    reads its verdict from it (a child process that need not import ComfyUI)."""
    return tmp_path_factory.mktemp("pinned-memo")


@pytest.fixture
def pinned_memo(pinned_verdicts, monkeypatch):
    monkeypatch.setenv("PIPETRAIN_PARITY_CACHE", str(pinned_verdicts))
    return pinned_verdicts / "parity.json"


def test_every_model_type_passes_on_the_pinned_comfyui_and_the_verdict_is_memoised(pinned_memo):
    memo = pinned_memo
    ensure_comfyui()
    results = {t: parity.check_model_type(t) for t in ADAPTERS}
    # but the types whose code a later ComfyUI brought: refused by name, by the release their adapter names (Flux 2
    # Klein, test_flux2_klein.py) or by the ComfyUI class this one lacks (Anima, test_anima.py)
    newer = {t for t in ADAPTERS if adapter_class(t).spec.min_comfyui}
    assert {t for t in newer if results.pop(t).needs_comfyui} == newer
    import comfy.supported_models as sm
    absent = {t for t in ADAPTERS if t not in newer
              and not any(hasattr(sm, c) for c in adapter_class(t).spec.comfy_configs)}
    assert absent == {"anima"}   # what 0.3.75 lacks: a type added here is named in this line
    for t in absent:
        r = results.pop(t)
        assert r.verdict == "lacks" and f"no comfy.supported_models.{adapter_class(t).spec.comfy_configs[0]}" in r.detail
    failed = {t: r.summary() for t, r in results.items() if not r.ok}
    assert not failed
    for t, r in results.items():
        assert r.comfyui_version == PINNED_VERSION and not r.memoised
        assert r.max_difference <= parity.TOLERANCE[adapter_class(t).parity_dtype] * r.scale
        assert r.scale > 0.1 and r.lora_keys > 0 and not r.lora_keys_unmapped, t
    assert results["sdxl"].lora_keys == 132 and results["flux"].lora_keys == 26
    start = time.perf_counter()
    again = parity.check_model_type("flux")
    assert time.perf_counter() - start < 0.5
    assert again.memoised and again.max_difference == results["flux"].max_difference
    assert memo.is_file()


def test_a_model_type_without_code_here_is_refused_by_name(memo):
    r = parity.check_model_type("krea2")
    assert r.verdict == "lacks" and not r.ok
    assert "'krea2' (Krea 2)" in r.detail and "0.27.0" in r.detail


@pytest.mark.slow
@pytest.mark.parametrize("version", [PINNED_VERSION, "0.33.0"])
def test_a_one_line_change_in_comfyuis_block_maths_refuses_the_run_before_caching(version, tmp_path, memo,
                                                                                    micro_flux_files, make_run,
                                                                                    monkeypatch):
    host = PINNED_COMFYUI if version == PINNED_VERSION else other_comfyuis().get(version)
    if host is None:
        pytest.skip(f"ComfyUI {version} is not in {comfyui_cache()} (scripts/comfyui_cache.sh writes it)")
    changed = planted_copy(host, tmp_path / "ComfyUI", FLUX_BLOCK, GATE_LINE, PLANTED)
    for name, value in python_env(changed).items():   # its extra packages (comfy-kitchen) where it needs them
        monkeypatch.setenv(name, value)
    config = make_run(micro_flux_files, images=2, stages=1, epochs=1)
    run = train(config, ranks=1, timeout=600)
    assert run.returncode != 0
    status = run.status()
    assert status["state"] == "failed"
    message = status["error"]
    for part in ("'flux'", f"ComfyUI {version} ({changed})", "computes something other than",
                 "largest difference", "the input of double_blocks.1.img_attn.qkv", "COMFYUI_PATH",
                 # and no fallback (backend/parity/fallback.py): the host's own forward differs from the pinned copy's
                 f"did not fall back to its pinned ComfyUI {PINNED_VERSION}",
                 # 0.33.0 names Flux's RMSNorm weights otherwise than the pinned copy (files load on both): the two
                 # forwards cannot share weights by name, so nothing proves the pinned copy's maths the host's
                 "differs from the pinned" if version == PINNED_VERSION else "weights are laid out differently"):
        assert part in message, (part, message)
    (which,) = run.events("comfyui")
    assert not which["pinned"] and which["refused"]
    if version == PINNED_VERSION:
        assert which["host_vs_pinned"] > 1e-3 * which["scale"]
    (check,) = run.events("parity")
    assert check["verdict"] == "differs" and check["model_type"] == "flux"
    assert check["max_difference"] > 1e-3 * check["scale"]
    assert status["comfyui"]["version"] == version and status["comfyui"]["path"] == str(changed)
    assert run.events("start")[0]["comfyui"]["version"] == version
    # which comfy-kitchen kernels training runs eager: none on the pinned ComfyUI, RoPE among them on 0.33
    assert ("apply_rope" in status["comfyui"]["kitchen_eager_in_training"]) == (version != PINNED_VERSION)
    cache = config.parent / "output" / "cache"
    assert not cache.exists() or not any(cache.rglob("*.safetensors")), "the refused run cached"


# ComfyUI's newer Wan feed-forward runs its down-projection as a fused kernel on the weight (the Linear module, and
# with it the hook that carries PipeTrain's LoRA, is bypassed): the same maths without a LoRA, not with one
WAN_BLOCK = "comfy/ldm/wan/model.py"
WAN_FFN = "y = self.ffn(torch.addcmul(repeat_e(e[3], x), self.norm2(x), 1 + repeat_e(e[4], x)))"
WAN_FFN_BYPASS = ("y = torch.nn.functional.linear(self.ffn[1](self.ffn[0](torch.addcmul(repeat_e(e[3], x), "
                  "self.norm2(x), 1 + repeat_e(e[4], x)))), self.ffn[2].weight, self.ffn[2].bias)")


def test_a_comfyui_module_that_bypasses_the_lora_hooks_is_refused(tmp_path):
    changed = planted_copy(PINNED_COMFYUI, tmp_path / "ComfyUI", WAN_BLOCK, WAN_FFN, WAN_FFN_BYPASS,
                           occurrences=2)   # Wan's block and its audio variant's
    (wan,) = doctor(changed, "wan", PIPETRAIN_PARITY_CACHE=str(tmp_path / "memo"))["parity"]
    assert wan["verdict"] == "differs", wan
    assert wan["max_difference"] < 1e-8 * wan["scale"]          # without a LoRA the maths is the same
    assert wan["lora_difference"] > 1e-4 * wan["scale"] and "bypass" in wan["detail"]


def test_a_comfyui_path_without_a_backward_is_refused(tmp_path):
    """A block whose feed-forward output leaves autograd (as a fused inference kernel without a backward would)
    computes the same forward, LoRA included, but trains nothing there."""
    changed = planted_copy(PINNED_COMFYUI, tmp_path / "ComfyUI", WAN_BLOCK, WAN_FFN, f"{WAN_FFN[:-1]}).detach()",
                           occurrences=2)
    (wan,) = doctor(changed, "wan", PIPETRAIN_PARITY_CACHE=str(tmp_path / "memo"))["parity"]
    assert wan["verdict"] == "differs" and "no usable gradient" in wan["detail"], wan
    assert wan["lora_difference"] < 1e-8 * wan["scale"] and wan["where"].endswith("ffn.0"), wan


def test_doctor_prints_the_comfyui_the_environment_and_a_verdict_per_model_type(pinned_verdicts):
    # SDXL's verdict memoised by test_every_model_type_passes_... where it ran first
    out = subprocess.run([sys.executable, "-m", "pipetrain", "doctor", "--model-type", "sdxl", "--model-type", "krea2"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PIPETRAIN_PARITY_CACHE": str(pinned_verdicts),
                              "COMFYUI_PATH": str(PINNED_COMFYUI)})
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    lines = lines[next(i for i, line in enumerate(lines) if line.startswith("ComfyUI ")):]   # after import chatter
    assert lines[0].startswith(f"ComfyUI     {PINNED_VERSION} at {PINNED_COMFYUI.resolve()} (tested;")
    assert any(line.startswith("torch ") for line in lines) and any(line.startswith("DeepSpeed ") for line in lines)
    assert any(line.startswith("sdxl ") and "passes" in line and "132 LoRA keys" in line for line in lines)
    assert any(line.startswith("krea2 ") and "refused" in line for line in lines)
    assert lines[-1].startswith("1 of 2 model types train on this ComfyUI")


def test_the_check_runs_where_the_caller_is_in_inference_mode(memo):
    """ComfyUI runs nodes (the Model node asks for the verdict) under torch.inference_mode."""
    import torch

    ensure_comfyui()
    with torch.inference_mode():
        r = parity.check_model_type("auraflow", use_memo=False)
    assert r.ok, r.summary()
