"""PipeTrain against other real ComfyUIs than the pinned one (``.comfyui/ComfyUI-<version>``: scripts/setup.sh
extracts 0.3.52; a 0.3.64 extracted from ComfyUI's git history is used where present; 0.8.0 and 0.33.0 from the
machine's ComfyUI cache, ``comfyui_copies.comfyui_cache``). Each runs in a child
process (ComfyUI is imported once per process): every model type's parity verdict, as the
compatibility table in docs/models.md shows it, and one end-to-end run whose LoRA that ComfyUI's own
LoraLoaderModelOnly loads."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
from comfyui_copies import NEWER_VERSIONS, comfyui_cache, doctor, other_comfyuis, planted_copy, python_env
from conftest import MATCH_TOLERANCE, MIN_EFFECT, last_json, python_child, train
from test_parity import FLUX_BLOCK, GATE_LINE, PLANTED

from pipetrain.backend.models.registry import ADAPTERS, arch_spec

COMFYUIS = other_comfyuis()
# model type -> the first ComfyUI release with its code, where its adapter names one (a refusal names it)
MIN_COMFYUI = {t: arch_spec(t).min_comfyui for t in ADAPTERS if arch_spec(t).min_comfyui}

# model type -> verdict where it is not "passes" (docs/models.md's compatibility table, and why)
# Flux 2 Klein's text encoder arrived in 0.9.2, Anima's class after 0.8.0, Ernie-Image's in 0.19.0
_BEFORE_KLEIN = {"flux2_klein": "lacks", "anima": "lacks", "ernie_image": "lacks"}
_BEFORE_FLUX2 = {**_BEFORE_KLEIN, "flux2": "lacks", "flux2_edit": "lacks", "hunyuan_video_15": "lacks",
                 "z_image": "lacks",
                 "lumina2": "fails",           # NextDiT takes no rope_theta yet
                 "hunyuan_video": "fails"}     # HunyuanVideoParams lacks the newer fields
EXPECTED = {
    "0.3.64": {**_BEFORE_FLUX2, "hunyuan_image_21": "fails",
               "qwen_image": "fails", "qwen_image_edit": "fails",     # RoPE in another layout
               "qwen_image_edit_plus": "fails"},
    # blocks take no transformer_options (nor attention overrides) before 0.3.6x
    "0.3.52": {**_BEFORE_FLUX2, "hunyuan_image_21": "lacks",
               **dict.fromkeys(("sd3", "wan", "wan_i2v", "wan_flf2v", "wan_vace", "wan_fun_control", "wan22_5b",
                                "wan22_5b_i2v", "qwen_image", "qwen_image_edit", "qwen_image_edit_plus",
                                "cosmos_predict2", "cosmos", "hidream", "omnigen2", "ltx_video", "ltx_video_i2v",
                                "ace_step"),
                               "fails")},
    "0.8.0": _BEFORE_KLEIN,
}
needs_comfyui = pytest.mark.skipif(not COMFYUIS, reason="no other ComfyUI beside the pinned one: run scripts/setup.sh")


@pytest.fixture(scope="module")
def memo(tmp_path_factory):
    """The parity verdicts of this file's ComfyUIs, taken once: test_parity_of_every_model_type takes every type's on
    each (first in the file, from an empty memo); the runs and the doctor table after it read theirs from it."""
    return tmp_path_factory.mktemp("parity-memo")


@needs_comfyui
@pytest.mark.parametrize("version", sorted(COMFYUIS))
def test_parity_of_every_model_type(version, memo):
    # forked from the warm server of that ComfyUI, which its run in test_lora_trained_on_that_comfyui_... uses again
    report = doctor(COMFYUIS[version], warm=True, PIPETRAIN_PARITY_CACHE=str(memo))
    assert report["comfyui"]["version"] == version
    verdicts = {r["model_type"]: r for r in report["parity"]}
    assert set(verdicts) == set(ADAPTERS)
    expected = EXPECTED.get(version, {})
    got = {t: r["verdict"] for t, r in verdicts.items() if r["verdict"] != "passes"}
    assert got == expected, {t: verdicts[t]["summary"] for t in set(got) ^ set(expected)}
    for t, r in verdicts.items():
        if r["verdict"] == "passes":
            assert r["max_difference"] <= 1e-4 * r["scale"] and r["lora_keys"] > 0, r
            if version in NEWER_VERSIONS and r["dtype"] == "float64":
                # float64 against ComfyUI's eager paths to rounding, and float32 against its fused kernels
                assert r["max_difference"] <= 1e-12 * r["scale"], r
                assert r["kernel_difference"] is not None and r["kernel_difference"] <= 1e-5 * r["scale"], r
        elif r["verdict"] == "lacks":   # the missing class, or the release that brought the model's code
            needs = MIN_COMFYUI.get(t)
            assert "no comfy.supported_models." in r["detail"] or f"needs ComfyUI {needs} or newer" in r["detail"], r
        else:
            assert r["where"] and r["detail"]


_CHECK_LORA = """
import json, sys
from pathlib import Path
from pipetrain.backend.config import load_run_config
from pipetrain.backend.host.runtime import comfyui_version
from pipetrain.backend.parity.verify import check_lora
check = check_lora(load_run_config(sys.argv[1]), Path(sys.argv[2]))
print(json.dumps({**check.__dict__, "version": comfyui_version()}))
"""


@pytest.mark.slow
@needs_comfyui
@pytest.mark.parametrize("version", sorted(COMFYUIS))
def test_lora_trained_on_that_comfyui_loads_in_its_lora_loader(version, model_files, make_run, monkeypatch, memo):
    comfyui = COMFYUIS[version]
    for name, value in python_env(comfyui).items():   # its extra packages (comfy-kitchen) where it needs them
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PIPETRAIN_PARITY_CACHE", str(memo))   # the run's parity check: that ComfyUI's verdict
    # the newer ComfyUIs train Flux, whose RoPE runs through comfy-kitchen there; the older ones SDXL
    arch = "flux" if version in NEWER_VERSIONS else "sdxl"
    config = make_run(model_files(arch, "micro" if arch == "flux" else "tiny"), images=2, stages=1, epochs=2,
                      model={"type": arch})
    run = train(config, ranks=1, timeout=600)
    assert run.returncode == 0, run.output[-4000:]
    assert run.events("start")[0]["comfyui"]["version"] == version
    (check,) = run.events("parity")
    assert check["verdict"] == "passes" and check["comfyui_version"] == version
    lora = run.loras()[-1]
    # a child importing that ComfyUI: forked from the server its ranks forked from (this environment's)
    out = python_child([str(config), str(lora)], dict(os.environ), code=_CHECK_LORA, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = last_json(out.stdout)
    assert loaded["version"] == version
    assert loaded["keys_loaded"] == (132 if arch == "sdxl" else check["lora_keys"])
    assert loaded["comfy_vs_training"] < MATCH_TOLERANCE * max(1.0, loaded["scale"])
    assert loaded["lora_effect"] > MIN_EFFECT


def _newer(version: str) -> Path:
    if version not in COMFYUIS:
        pytest.skip(f"ComfyUI {version} is not in {comfyui_cache()} (scripts/comfyui_cache.sh writes it)")
    return COMFYUIS[version]


@pytest.mark.parametrize("version", NEWER_VERSIONS)
def test_a_one_line_change_in_a_newer_comfyuis_flux_block_is_refused(version, tmp_path):
    changed = planted_copy(_newer(version), tmp_path / "ComfyUI", FLUX_BLOCK, GATE_LINE, PLANTED)
    (flux,) = doctor(changed, "flux", PIPETRAIN_PARITY_CACHE=str(tmp_path / "memo"))["parity"]
    assert flux["comfyui_version"] == version
    assert flux["verdict"] == "differs" and flux["max_difference"] > 1e-3 * flux["scale"], flux
    assert flux["where"] == "the input of double_blocks.1.img_attn.qkv (the first module whose output differs)", flux


_KITCHEN = """
import json, torch
from pipetrain.backend.host.runtime import comfy_training_paths, ensure_comfyui
ensure_comfyui()
import comfy.ldm.flux.math as fm
import comfy_kitchen, comfy_kitchen.backends.eager as eager
from pipetrain.backend.host.patches_comfyui import kitchen_in_training
from comfy.ldm.flux.math import rope
pe = rope(torch.arange(6.0).reshape(1, 6), 8, 10000).unsqueeze(1)
g = torch.Generator().manual_seed(0)
q, k = (torch.randn(1, 2, 6, 8, generator=g, requires_grad=True) for _ in range(2))
out = {"routed": kitchen_in_training()}
try:   # ComfyUI's own RoPE as its inference path runs it: the fused kernel, which has no backward
    sum(t.sum() for t in fm.apply_rope(q, k, pe)).backward()
    out["inference_backward"] = "ok"
except RuntimeError as e:
    out["inference_backward"] = str(e).splitlines()[0]
with comfy_training_paths(True):
    got = fm.apply_rope(q, k, pe) if hasattr(fm, "apply_rope") else None
    w = [torch.randn(t.shape, generator=g) for t in got]
    grads = torch.autograd.grad(sum((t * wi).sum() for t, wi in zip(got, w)), (q, k))
    out["bound_in_training"] = "comfy_kitchen.backends.eager" in (
        getattr(fm.apply_rope, "__module__", "") + getattr(comfy_kitchen.apply_rope, "__module__", ""))
# after the training paths: the fused kernel is back where ComfyUI looks it up
out["restored"] = fm.apply_rope is not eager.apply_rope and comfy_kitchen.apply_rope is not eager.apply_rope
fused = [t.detach() for t in torch.ops.comfy_kitchen.apply_rope(q.detach(), k.detach(), pe)]
out["forward_vs_fused"] = max(float((a.detach() - b).abs().max()) for a, b in zip(got, fused))
# the eager backend's gradient is the derivative of its forward (float64, finite differences)
q64, k64, pe64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_(), pe.double()
out["gradcheck"] = torch.autograd.gradcheck(lambda a, b: eager.apply_rope(a, b, pe64), (q64, k64), eps=1e-6,
                                            atol=1e-8)
print(json.dumps(out))
"""


@pytest.mark.parametrize("version", NEWER_VERSIONS)
def test_comfy_kitchens_kernels_train_through_its_eager_backend_with_true_gradients(version):
    comfyui = _newer(version)
    run = python_child([], python_env(comfyui), code=_KITCHEN, timeout=300)   # forked from that ComfyUI's server
    assert run.returncode == 0, run.stderr[-3000:]
    out = last_json(run.stdout)
    assert {"apply_rope", "apply_rope1", "rms_rope_split_half", "rms_adaln"} <= set(out["routed"]), out
    assert "no autograd formula" in out["inference_backward"], out
    assert out["bound_in_training"] and out["restored"], out
    assert out["forward_vs_fused"] < 1e-6 and out["gradcheck"] is True, out


def test_doctor_tables_every_model_type_on_each_comfyui_given(memo):
    """``doctor --comfyui A --comfyui B``: one row a model type, one column a ComfyUI version (the other ComfyUIs'
    verdicts memoised by test_parity_of_every_model_type where it ran first)."""
    from pipetrain.backend.host.runtime import PINNED_COMFYUI

    # the pinned version, and the oldest and newest others present (each costs a child process)
    others = sorted(COMFYUIS, key=lambda v: tuple(int(x) for x in v.split(".")))
    others = [v for v in dict.fromkeys((others[0], others[-1]))] if others else []
    folders = [PINNED_COMFYUI, *(COMFYUIS[v] for v in others)]
    argv = [sys.executable, "-m", "pipetrain", "doctor", "--model-type", "flux", "--model-type", "z_image"]
    for f in folders:
        argv += ["--comfyui", str(f)]
    env = {**python_env(COMFYUIS.get("0.33.0", PINNED_COMFYUI)), "PIPETRAIN_PARITY_CACHE": str(memo)}
    out = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    header = next(line for line in lines if line.startswith("model type"))
    versions = header.split()[2:]
    assert versions == ["0.3.75", *others], header
    # Z-Image's code arrived after 0.3.52; everything else passes everywhere
    expected = {"flux": ["passes"] * len(versions),
                "z_image": ["refused (lacks)" if v == "0.3.52" else "passes" for v in versions]}
    for t, cells in expected.items():
        row = next(line for line in lines if line.startswith(t + " "))
        assert row.split(None, 1)[1].split() == " ".join(cells).split(), row
    assert f"ComfyUI 0.3.75 ({PINNED_COMFYUI.resolve()}): 2 of 2 model types train" in lines, lines
