"""PipeTrain against other real ComfyUIs than the pinned one (``.comfyui/ComfyUI-<version>``: scripts/setup.sh
extracts 0.3.52; a 0.3.64 extracted from ComfyUI's git history is used where present). Each runs in a child
process (ComfyUI is imported once per process): every model type's parity verdict, as the README's
compatibility table shows it, and one end-to-end run whose LoRA that ComfyUI's own LoraLoaderModelOnly loads."""
import json
import subprocess
import sys

import pytest
from comfyui_copies import doctor, other_comfyuis, python_env
from conftest import MATCH_TOLERANCE, MIN_EFFECT, train

from pipetrain.backend.models.registry import ADAPTERS

COMFYUIS = other_comfyuis()

# model type -> verdict where it is not "passes" (the README's compatibility table, and why)
_BEFORE_FLUX2 = {"flux2": "lacks", "flux2_edit": "lacks", "hunyuan_video_15": "lacks", "z_image": "lacks",
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
}
needs_comfyui = pytest.mark.skipif(not COMFYUIS, reason="no other ComfyUI beside the pinned one: run scripts/setup.sh")


@needs_comfyui
@pytest.mark.parametrize("version", sorted(COMFYUIS))
def test_parity_of_every_model_type(version, tmp_path):
    report = doctor(COMFYUIS[version], PIPETRAIN_PARITY_CACHE=str(tmp_path))
    assert report["comfyui"]["version"] == version
    verdicts = {r["model_type"]: r for r in report["parity"]}
    assert set(verdicts) == set(ADAPTERS)
    expected = EXPECTED.get(version, {})
    got = {t: r["verdict"] for t, r in verdicts.items() if r["verdict"] != "passes"}
    assert got == expected, {t: verdicts[t]["summary"] for t in set(got) ^ set(expected)}
    for t, r in verdicts.items():
        if r["verdict"] == "passes":
            assert r["max_difference"] <= 1e-4 * r["scale"] and r["lora_keys"] > 0, r
        elif r["verdict"] == "lacks":
            assert "no comfy.supported_models." in r["detail"]
        else:
            assert r["where"] and r["detail"]


_CHECK_LORA = """
import json, sys
from pathlib import Path
from pipetrain.backend.config import load_run_config
from pipetrain.backend.runtime import comfyui_version
from pipetrain.backend.verify import check_lora
check = check_lora(load_run_config(sys.argv[1]), Path(sys.argv[2]))
print(json.dumps({**check.__dict__, "version": comfyui_version()}))
"""


@pytest.mark.slow
@needs_comfyui
@pytest.mark.parametrize("version", sorted(COMFYUIS))
def test_lora_trained_on_that_comfyui_loads_in_its_lora_loader(version, tiny_sdxl_files, make_run, monkeypatch,
                                                              tmp_path):
    comfyui = COMFYUIS[version]
    monkeypatch.setenv("COMFYUI_PATH", str(comfyui))
    monkeypatch.setenv("PIPETRAIN_PARITY_CACHE", str(tmp_path / "memo"))
    config = make_run(tiny_sdxl_files, images=2, stages=1, epochs=2, model={"type": "sdxl"})
    run = train(config, ranks=1, timeout=600)
    assert run.returncode == 0, run.output[-4000:]
    assert run.events("start")[0]["comfyui"]["version"] == version
    (check,) = run.events("parity")
    assert check["verdict"] == "passes" and check["comfyui_version"] == version
    lora = run.loras()[-1]
    out = subprocess.run([sys.executable, "-c", _CHECK_LORA, str(config), str(lora)], capture_output=True, text=True,
                         timeout=300, env=python_env(comfyui))
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded["version"] == version
    assert loaded["keys_loaded"] == 132
    assert loaded["comfy_vs_training"] < MATCH_TOLERANCE * max(1.0, loaded["scale"])
    assert loaded["lora_effect"] > MIN_EFFECT
