# SPDX-License-Identifier: GPL-3.0-or-later
"""ACE-Step from ComfyUI's all-in-one checkpoint (``ace_step_v1_3.5b.safetensors`` in models/checkpoints): a tiny
checkpoint written by ComfyUI's own save_checkpoint loads in ComfyUI's CheckpointLoaderSimple (the layout is real),
and with [model] naming the checkpoint alone the VAE and text encoders come out of it, giving the same latents and
text embeddings as the separate files of the same weights."""
import functools
import math

import pytest
import torch

from pipetrain.backend.host.runtime import comfy_nodes, ensure_comfyui

ensure_comfyui()
pytest.importorskip("torchaudio")   # ComfyUI's ACE VAE builds its mel filter bank with torchaudio

TAGS, LYRICS = "rock, electric guitar", "[verse]\nhello hello\n[chorus]\nla la"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(the checkpoint, the separate files of the same weights)."""
    from pipetrain.backend.models import tiny

    root = tmp_path_factory.mktemp("ace_ckpt")
    return tiny.write_checkpoint("ace_step", root / "ckpt" / "ace_step_tiny.safetensors"), \
        tiny.write_model_files("ace_step", root / "split", "tiny")


def _adapters(files):
    from pipetrain.backend.config import ModelConfig
    from pipetrain.backend.models.ace_step import AceStepAdapter

    checkpoint, split = files
    return (AceStepAdapter(ModelConfig(type="ace_step", diffusion_model=str(checkpoint), dtype="float32")),
            AceStepAdapter(ModelConfig(type="ace_step", diffusion_model=str(split.diffusion_model), vae=str(split.vae),
                                       text_encoders=[str(p) for p in split.text_encoders], dtype="float32")))


def _song(seconds: float = 2.0, rate: int = 44100) -> torch.Tensor:
    t = torch.arange(int(seconds * rate)) / rate
    return torch.stack([torch.sin(2 * math.pi * 220 * t), 0.5 * torch.sin(2 * math.pi * 330 * t)])


def test_the_checkpoint_has_comfyuis_layout_and_loads_in_checkpoint_loader_simple(files, monkeypatch):
    """The keys are ComfyUI's for ACE-Step (supported_models.ACEStep: ``vae.``, ``text_encoders.``; the diffusion
    model under ``model.diffusion_model.``), and CheckpointLoaderSimple returns the same model, VAE and text
    encoders as the separate files: equal weights, latents and embeddings. A tiny file's only extra: its narrow
    configs from the metadata (``comfy_reads_checkpoint``, the text encoders' as options, in float32 as PipeTrain
    loads them: ComfyUI's own choice on a CPU is float16)."""
    import comfy.sd
    import folder_paths
    from comfy_extras.nodes_ace import TextEncodeAceStepAudio
    from safetensors import safe_open

    from pipetrain.backend.models.checkpoint_file import comfy_reads_checkpoint, text_encoder_options

    checkpoint, split = files
    with safe_open(str(checkpoint), framework="pt") as f:
        prefixes = {k.split(".")[0] for k in f.keys()}
        assert prefixes == {"model", "vae", "text_encoders"}
        assert any(k.startswith("model.diffusion_model.transformer_blocks.") for k in f.keys())
        assert any(k.startswith("text_encoders.umt5base.transformer.") for k in f.keys())
        assert any(k.startswith("vae.vocoder.") for k in f.keys())
    monkeypatch.setattr(folder_paths, "folder_names_and_paths", dict(folder_paths.folder_names_and_paths))
    folder_paths.folder_names_and_paths["checkpoints"] = ([str(checkpoint.parent)], {".safetensors"})
    guess = comfy.sd.load_checkpoint_guess_config
    with comfy_reads_checkpoint(checkpoint, "ace_step") as metadata:
        monkeypatch.setattr(comfy.sd, "load_checkpoint_guess_config",
                            functools.partial(guess, te_model_options=text_encoder_options(metadata, torch.float32)))
        model, clip, vae = comfy_nodes().CheckpointLoaderSimple().load_checkpoint(checkpoint.name)
    assert type(model.model).__name__ == "ACEStep"

    _, separate = _adapters(files)
    separate.load_diffusion_model()
    theirs = model.model.diffusion_model.state_dict()
    ours = separate.diffusion_model.state_dict()
    assert set(theirs) == set(ours) and all(torch.equal(theirs[k].float().cpu(), ours[k].float().cpu()) for k in ours)
    song = _song()
    torch.testing.assert_close(separate.encode_audio(vae, song, 44100),
                               separate.encode_audio(separate.load_vae(), song, 44100), rtol=0, atol=0)
    node = TextEncodeAceStepAudio.execute(clip, TAGS, LYRICS, 1.0)[0]
    split_text = separate.encode_song(separate.load_text_encoders(), TAGS, LYRICS)
    torch.testing.assert_close(node[0][0][0].float(), split_text["cond"], rtol=0, atol=0)
    assert torch.equal(node[0][1]["conditioning_lyrics"][0].long(), split_text["lyrics"])


def test_vae_and_text_encoders_come_from_the_checkpoint_when_the_config_names_none(files):
    """[model] with the checkpoint alone: every role's file is the checkpoint (so the cache keys follow it), and
    the latents, tags + lyrics and diffusion weights equal those of the separate files, exactly."""
    checkpoint, _ = files
    whole, separate = _adapters(files)
    assert whole.model_files() == {"diffusion_model": [checkpoint], "vae": [checkpoint], "text_encoders": [checkpoint]}
    assert whole.from_checkpoint() == {"vae", "text_encoders"} and separate.from_checkpoint() == set()
    song = _song(2.3, 22050)
    latent = whole.encode_audio(whole.load_vae(), song, 22050)
    assert latent.shape == (8, 16, ((25 * 4096 - 2048) // 512 + 1) // 8) and latent.abs().max() > 0   # 2.3 s
    torch.testing.assert_close(latent, separate.encode_audio(separate.load_vae(), song, 22050), rtol=0, atol=0)
    text, split_text = (a.encode_song(a.load_text_encoders(), TAGS, LYRICS) for a in (whole, separate))
    torch.testing.assert_close(text["cond"], split_text["cond"], rtol=0, atol=0)
    assert torch.equal(text["lyrics"], split_text["lyrics"]) and text["lyrics"].shape[0] > 3
    whole.load_diffusion_model()
    separate.load_diffusion_model()
    a, b = whole.diffusion_model.state_dict(), separate.diffusion_model.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in b)


def test_a_bare_diffusion_model_without_vae_or_text_encoders_says_which_key_to_set(files):
    from pipetrain.backend.config import ModelConfig
    from pipetrain.backend.errors import ModelError
    from pipetrain.backend.models.ace_step import AceStepAdapter

    _, split = files
    bare = AceStepAdapter(ModelConfig(type="ace_step", diffusion_model=str(split.diffusion_model)))
    with pytest.raises(ModelError, match=r"holds no VAE.*\[model\] vae"):
        bare.load_vae()
    with pytest.raises(ModelError, match=r"holds no text encoders.*\[model\] text_encoders"):
        bare.load_text_encoders()


def test_model_node_takes_vae_and_text_encoders_from_the_checkpoint(monkeypatch):
    """The Model node's "(from the checkpoint)" choices leave [model] vae and text_encoders out."""
    import folder_paths

    import pipetrain.nodes.data as data

    patches = []
    monkeypatch.setattr(data, "check_model_patch", patches.append)
    monkeypatch.setattr(data, "model_input_error", lambda *a: None)
    monkeypatch.setattr(data, "model_path", lambda name: "/models/checkpoints/" + name)
    monkeypatch.setattr(data, "detect", lambda path, model_type: "ace_step")
    monkeypatch.setattr(data, "parity_text", lambda model_type: "")
    monkeypatch.setattr(folder_paths, "get_full_path_or_raise", lambda kind, name: f"/models/{kind}/{name}")
    # the node takes only the files its combos list (nodes/declared.py)
    monkeypatch.setattr(folder_paths, "get_filename_list", lambda kind: ["ace.safetensors", "umt5_base.safetensors",
                                                                         "ace_vae.safetensors", "t5.safetensors"])
    data.ModelNode.execute("ace.safetensors", data.FROM_CHECKPOINT, data.NONE, data.FROM_CHECKPOINT, "default",
                           "bfloat16")
    data.ModelNode.execute("ace.safetensors", "umt5_base.safetensors", data.NONE, "ace_vae.safetensors", "default",
                           "bfloat16")
    table = [p.table()["model"] for p in patches]
    assert "vae" not in table[0] and not table[0].get("text_encoders")
    assert table[1]["vae"] == "/models/vae/ace_vae.safetensors"
    assert list(table[1]["text_encoders"]) == ["/models/text_encoders/umt5_base.safetensors"]
    with pytest.raises(ValueError, match="text_encoder_2 .. 4 to none"):
        data.ModelNode.execute("ace.safetensors", data.FROM_CHECKPOINT, "t5.safetensors", data.FROM_CHECKPOINT,
                               "default", "bfloat16")


def test_the_model_node_checks_that_the_file_holds_what_it_is_to_give(files):
    """Queue time, from the header: the checkpoint passes; a bare diffusion model picked with "(from the
    checkpoint)" fails naming the key, for the VAE and for the text encoders."""
    from pipetrain.launcher.forms import model_patch
    from pipetrain.nodes.data import check_model_patch

    checkpoint, split = files
    check_model_patch(model_patch("ace_step", str(checkpoint), None))
    bare = str(split.diffusion_model)
    with pytest.raises(ValueError, match=r"holds no VAE.*\[model\] vae"):
        check_model_patch(model_patch("ace_step", bare, None, [str(p) for p in split.text_encoders]))
    with pytest.raises(ValueError, match=r"holds no text encoders.*\[model\] text_encoders"):
        check_model_patch(model_patch("ace_step", bare, str(split.vae)))
    check_model_patch(model_patch("ace_step", bare, str(split.vae), [str(p) for p in split.text_encoders]))


def test_a_toml_run_that_leaves_the_vae_to_a_file_without_one_is_refused_before_caching(files, tmp_path):
    """The CLI's path (no Model node): ``pipetrain train`` on a config whose [model] names a bare diffusion model and
    no vae is refused at start, naming the file and the key, before any cache or run folder is made."""
    import subprocess
    import sys

    import tomli_w

    from pipetrain.backend.commands.demo import make_dataset

    _, split = files
    make_dataset(tmp_path / "dataset", 2)
    (tmp_path / "dataset.toml").write_text(tomli_w.dumps(
        {"resolutions": [64], "directory": [{"path": str(tmp_path / "dataset")}]}))
    (tmp_path / "run.toml").write_text(tomli_w.dumps({
        "output_dir": str(tmp_path / "output"), "dataset": "dataset.toml", "epochs": 1,
        "model": {"type": "ace_step", "diffusion_model": str(split.diffusion_model),
                  "text_encoders": [str(p) for p in split.text_encoders], "dtype": "float32"}}))
    out = subprocess.run([sys.executable, "-m", "pipetrain", "train", str(tmp_path / "run.toml")],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"pipetrain: error: {split.diffusion_model}: this file holds no VAE" in out.stderr
    assert "name the VAE file in [model] vae" in out.stderr
    assert not (tmp_path / "output").exists()                        # nothing cached, no run folder
