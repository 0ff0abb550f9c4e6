"""The adapter registry: every model type names its adapter and file facts; models whose code the pinned
ComfyUI lacks fail config validation at once, naming the ComfyUI that has them."""
import pytest

from pipetrain.backend.errors import ConfigError
from pipetrain.backend.models import registry
from pipetrain.backend.preflight import load_run
from pipetrain.backend.models import encoders, vaes
from pipetrain.backend.models.spec import SIZES
from pipetrain.backend.host.runtime import PINNED_VERSION
from pipetrain.backend.host.versions import TESTED_VERSIONS

RUN = """
output_dir = "out"
dataset = "dataset.toml"
[model]
type = "{type}"
diffusion_model = "model.safetensors"
vae = "vae.safetensors"
"""


def _config(tmp_path, model_type):
    (tmp_path / "dataset.toml").write_text('[[directory]]\npath = "images"\n')
    (tmp_path / "run.toml").write_text(RUN.format(type=model_type))
    return tmp_path / "run.toml"


@pytest.mark.parametrize("model_type", sorted(registry.NEEDS_NEWER_COMFYUI))
def test_models_our_comfyui_lacks_fail_validation_naming_the_comfyui_that_has_them(tmp_path, model_type):
    name, version = registry.NEEDS_NEWER_COMFYUI[model_type]
    with pytest.raises(ConfigError) as err:
        load_run(_config(tmp_path, model_type))
    message = str(err.value)
    assert "model.type" in message and name in message and f"ComfyUI {PINNED_VERSION}" in message
    assert (f"ComfyUI {version} or newer" if version else f"a ComfyUI newer than {PINNED_VERSION}") in message
    with pytest.raises(KeyError, match="needs model code"):
        registry.adapter_class(model_type)


def test_unknown_type_lists_the_supported_ones(tmp_path):
    with pytest.raises(ConfigError, match="supported model types: " + ", ".join(sorted(registry.ADAPTERS))):
        load_run(_config(tmp_path, "fluxx"))


@pytest.mark.parametrize("model_type", sorted(registry.ADAPTERS))
def test_every_adapter_declares_its_files(model_type):
    """What loading.py and tiny.py read: a spec whose components exist, for every size."""
    cls = registry.adapter_class(model_type)
    assert cls.arch == model_type and not set(registry.NEEDS_NEWER_COMFYUI) & {model_type}
    spec = registry.arch_spec(model_type)
    assert spec.vae in vaes.kinds() and spec.text_encoders
    assert all(k in encoders.kinds() for kinds in spec.text_encoder_sets() for k in kinds)
    assert spec.comfy_configs and set(spec.detected_sizes) <= set(SIZES)
    assert all(isinstance(spec.unet_config(size), dict) for size in SIZES)
    # on the newest tested ComfyUI every type trains (a type whose code a later ComfyUI brought names the release)
    assert registry.unavailable_reason(model_type, TESTED_VERSIONS[-1]) is None
    assert spec.min_comfyui == "" or registry.unavailable_reason(model_type, "0.3.75")


def test_only_adapters_and_the_registry_name_architectures():
    """Adding a model touches its adapter file and one registry line: the loaders, the tiny-file writer, the
    data, cache and training code, the config, diffusion-pipe's spellings and check-config never branch on a model
    type (they read the adapters' declared facts)."""
    from pathlib import Path

    backend = Path(registry.__file__).resolve().parents[1]
    generic = [backend / "models" / "loading.py", backend / "models" / "checkpoint_file.py",
               backend / "models" / "tiny.py", backend / "sampling" / "render.py", backend / "sampling" / "audio.py",
               backend / "parity" / "verify.py", backend / "parity" / "check.py", backend / "commands" / "doctor.py",
               backend / "host" / "patches_comfyui.py", backend / "train" / "patches_deepspeed.py",
               backend / "config" / "compat.py", backend / "commands" / "check_config.py",
               backend / "commands" / "model_file_check.py", backend / "models" / "te_loading.py",
               *(backend / "config").glob("*.py"), *(backend / "data").glob("*.py"),
               *(backend / "cache").glob("*.py"),
               *(backend / "train").glob("*.py")]
    for path in generic:
        text = path.read_text()
        named = [t for t in registry.ADAPTERS if f'"{t}"' in text or f"'{t}'" in text]
        assert not named, f"{path.name} names {named}"


def test_adapter_classes_import_no_comfyui_until_an_adapter_is_made():
    """Config validation reads the adapter classes' facts, where ComfyUI's device probe must not run (``pipetrain
    launch`` would hold a GPU context through the run); constructing an adapter sets ComfyUI up, once."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from pipetrain.backend.config import ModelConfig\n"
            "from pipetrain.backend.models.registry import ADAPTERS, adapter_class\n"
            "comfy = lambda: sorted(m for m in sys.modules if m.split('.')[0] == 'comfy')\n"
            "facts = [(adapter_class(t).spec.clip_type, adapter_class(t).timestep_range) for t in ADAPTERS]\n"
            "print(comfy())\n"
            "adapter_class('flux')(ModelConfig(type='flux', diffusion_model='m', vae='v'))\n"
            "print('comfy.model_management' in comfy())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]", "True"]
