"""check-config reads the model files a config names (``backend/commands/model_file_check.py``): each file's or folder's
safetensors header, bounded, nothing unpickled; it reports the model type ComfyUI's detection finds and each text
encoder's kind, and a missing file, another model's folder, a text-encoder folder ComfyUI cannot load or a VAE of
another kind is an error under the key the user wrote. The configs are diffusion-pipe's tables with the tiny model
files in the layouts diffusion-pipe reads (``dp_files.py``)."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
from dp_files import DP_OPTIMIZER, diffusers_folder, wan_checkpoint_folder

from pipetrain.backend.commands.check_config import report
from pipetrain.backend.cli import main as cli_main

RUN = "output_dir = 'out'\ndataset = 'dataset.toml'\nepochs = 1\n" + DP_OPTIMIZER + "[adapter]\ntype = 'lora'\nrank = 4\n"


def _check(root: Path, model: str) -> tuple[str, bool]:
    (root / "dataset.toml").write_text("resolutions = [64]\n[[directory]]\npath = 'images'\n")
    (root / "run.toml").write_text(RUN + "[model]\n" + model + "dtype = 'bfloat16'\n")
    return report(root / "run.toml")


def _flux_table(files, **keys) -> str:
    table = {"type": "flux", "transformer_path": files.diffusion_model, "vae_path": files.vae,
             "clip_path": files.text_encoders[0], "t5_path": files.text_encoders[1], **keys}
    return "".join(f"{k} = '{v}'\n" for k, v in table.items() if v is not None)


def test_each_file_of_a_dp_table_reports_what_its_header_is(tmp_path, model_files, capsys):
    files = model_files("flux")
    _check(tmp_path, _flux_table(files))
    assert cli_main(["check-config", str(tmp_path / "run.toml")]) == 0
    out = capsys.readouterr().out
    for line in (f"  model.transformer_path: {files.diffusion_model}: a Flux diffusion model file (model type 'flux')",
                 f"  model.vae_path: {files.vae}: a VAE file decoding 16-channel latents",
                 f"  model.clip_path: {files.text_encoders[0]}: a CLIP-L text encoder file",
                 f"  model.t5_path: {files.text_encoders[1]}: a T5-XXL text encoder file",
                 "Loads: trains model type 'flux'."):
        assert line in out, (line, out)


def test_a_missing_file_is_an_error_naming_its_key_and_path(tmp_path, model_files, capsys):
    missing = tmp_path / "models" / "flux1-dev.safetensors"
    _check(tmp_path, _flux_table(model_files("flux"), transformer_path=missing))
    assert cli_main(["check-config", str(tmp_path / "run.toml")]) == 1
    out = capsys.readouterr().out
    assert f"  model.transformer_path: ERROR: {missing}: file or folder not found" in out, out
    assert "Does not load: 1 model file above is wrong" in out and "Loads:" not in out


def test_a_flux_folder_given_as_sd3_is_an_error_naming_the_folder_key(tmp_path, model_files):
    folder = diffusers_folder(model_files("flux"), tmp_path / "stable-diffusion-3.5-medium", "flux")
    text, ok = _check(tmp_path, f"type = 'sd3'\ndiffusers_path = '{folder}'\n")
    assert not ok
    assert (f"  model.diffusers_path: ERROR: {folder / 'transformer'}: model.type = 'sd3', but this file is a Flux "
            "diffusion model; set model.type = 'flux'") in text, text
    assert ("  model.diffusers_path: ERROR: sd3 needs the text encoders CLIP-L + CLIP-G + T5-XXL, one file each; got "
            "text_encoder: CLIP-L, text_encoder_2: T5-XXL") in text, text
    # the same folder as what it is loads
    text, ok = _check(tmp_path, f"type = 'flux'\ndiffusers_path = '{folder}'\n")
    assert ok and f"{folder / 'transformer'}: a Flux diffusion model folder (model type 'flux')" in text, text


def test_a_text_encoder_folder_comfyui_cannot_load_is_an_error_naming_its_key(tmp_path, model_files):
    folder = tmp_path / "bert-base"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 768}))
    (folder / "model.safetensors").write_bytes(Path(model_files("flux").text_encoders[0]).read_bytes())
    text, ok = _check(tmp_path, _flux_table(model_files("flux"), clip_path=folder))
    assert not ok
    assert f"  model.clip_path: ERROR: {folder}: ComfyUI reads no bert text encoder from a Hugging Face folder" in text
    # a folder with no safetensors weights: refused when the config loads, naming the key
    (folder / "model.safetensors").unlink()
    text, ok = _check(tmp_path, _flux_table(model_files("flux"), clip_path=folder))
    assert not ok and "Does not load:" in text and "no .safetensors weights in this folder" in text, text


def test_a_vae_of_another_model_is_an_error(tmp_path, model_files):
    sdxl_vae = model_files("sdxl").vae
    text, ok = _check(tmp_path, _flux_table(model_files("flux"), vae_path=sdxl_vae))
    assert not ok
    assert (f"  model.vae_path: ERROR: {sdxl_vae}: this VAE decodes 4-channel latents; flux needs a 16-channel KL "
            "VAE") in text, text


def test_a_pickled_file_is_never_unpickled(tmp_path, model_files):
    """Wan's checkpoint folder holds its VAE as a .pth: noted unread; a pickle that would touch a file when loaded
    leaves none."""
    import pickle

    folder = wan_checkpoint_folder(model_files("wan"), tmp_path / "Wan2.1-T2V-1.3B")
    marker = tmp_path / "unpickled"

    class Touch:
        def __reduce__(self):
            return (Path.touch, (marker,))
    (folder / "Wan2.1_VAE.pth").write_bytes(pickle.dumps(Touch()))
    text, ok = _check(tmp_path, f"type = 'wan'\nckpt_path = '{folder}'\nllm_path = '{model_files('wan').text_encoders[0]}'\n")
    assert ok, text
    assert f"  model.ckpt_path: {folder / 'Wan2.1_VAE.pth'}: not read: a pickled file" in text
    assert f"  model.ckpt_path: {folder}: a Wan 2.1 / 2.2 14B t2v diffusion model folder (model type 'wan')" in text
    assert not marker.exists()


def test_a_fifo_or_a_header_of_any_length_is_refused_without_reading_it(tmp_path, model_files):
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)   # opening it to read would block for ever without O_NONBLOCK, reading it too
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 2 ** 62) + b"{}")
    text, ok = _check(tmp_path, _flux_table(model_files("flux"), vae_path=fifo, clip_path=huge))
    assert not ok
    assert f"  model.vae_path: ERROR: {fifo}: not a regular file or folder" in text, text
    assert f"  model.clip_path: ERROR: {huge}: not a safetensors file (no header of a valid length)" in text, text


@pytest.mark.parametrize("arch", ["flux", "sd3", "sdxl", "sd15", "wan", "hunyuan_video", "lumina2", "qwen_image",
                                  "flux2", "ltx_video", "cosmos"])
def test_every_models_tiny_files_read_as_their_type(tmp_path, model_files, arch):
    """The header checks tell every model's own files apart correctly (no false error): type, VAE, text encoders."""
    files = model_files(arch)
    tes = ", ".join(f"'{p}'" for p in files.text_encoders)
    text, ok = _check(tmp_path, f"type = '{arch}'\ndiffusion_model = '{files.diffusion_model}'\nvae = '{files.vae}'\n"
                                f"text_encoders = [{tes}]\n")
    assert ok and "ERROR" not in text, text
    assert f"(model type '{arch}')" in text and text.count(" text encoder file\n") == len(files.text_encoders)
