# SPDX-License-Identifier: GPL-3.0-or-later
"""ACE-Step's epoch samples are songs: each prompt's tags (with [samples] lyrics) rendered from ComfyUI's
EmptyAceStepLatentAudio latent by ComfyUI's sampler with the epoch LoRA, decoded by VAEDecodeAudio and written as
SaveAudio writes (FLAC) beside the LoRA, where the image samples go; [samples] seconds and lyrics are checked."""
import tomli_w
import pytest
import torch

from pipetrain.backend.host.runtime import ensure_comfyui

ensure_comfyui()

TAGS = ["rock, electric guitar, drums", "solo piano, calm"]
LYRICS = "[verse]\nhello hello\n[chorus]\nla la la"


def _run_config(root, checkpoint, **samples):
    (root / "dataset.toml").write_text(tomli_w.dumps({"directory": [{"path": str(root)}]}))
    (root / "run.toml").write_text(tomli_w.dumps({
        "output_dir": str(root / "output"), "dataset": "dataset.toml", "epochs": 1,
        "model": {"type": "ace_step", "diffusion_model": str(checkpoint), "dtype": "float32"},
        "adapter": {"rank": 4}, "optimizer": {"type": "adamw", "lr": 1e-3},
        "samples": {"prompts": TAGS, "seconds": 2.0, "steps": 3, **samples}}))
    return root / "run.toml"


def _lora(path):
    """A LoRA on the first block's self-attention, in the keys PipeTrain saves (LoraLoaderModelOnly's)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    save_file({f"diffusion_model.transformer_blocks.0.attn.{n}.lora_{ab}.weight":
               torch.randn(*((4, 64) if ab == "A" else (64, 4)), generator=g) * 0.2
               for n in ("to_q", "to_v") for ab in "AB"}, str(path))
    return path


def test_epoch_samples_of_an_audio_model_are_flac_songs(tmp_path):
    """Each prompt gives ``<lora>-sampleNN.flac``: 44.1 kHz stereo, EmptyAceStepLatentAudio's 21 latent frames of a
    2 s request (int(2 x 44100 / 4096)) x 4096 samples, not silence, each prompt its own song; the tags were encoded
    with the lyrics (their text-cache entry) into the conditioning TextEncodeAceStepAudio makes."""
    pytest.importorskip("torchaudio")
    from comfy_extras.nodes_ace import TextEncodeAceStepAudio

    from pipetrain.backend.sampling import audio as sample_audio, render as sampling
    from pipetrain.backend.cache import CacheStore, text_key
    from pipetrain.backend.config import load_run_config
    from pipetrain.backend.models import tiny
    from pipetrain.backend.models.registry import adapter_class
    from pipetrain.backend.run.folder import cache_folder

    checkpoint = tiny.write_checkpoint("ace_step", tmp_path / "models" / "ace_step_tiny.safetensors")
    cfg = load_run_config(_run_config(tmp_path, checkpoint, lyrics=LYRICS))
    lora = _lora(tmp_path / "run-epoch0001.safetensors")
    paths = sampling.render(cfg, lora)
    assert [p.name for p in paths] == ["run-epoch0001-sample00.flac", "run-epoch0001-sample01.flac"]
    assert paths[0].read_bytes()[:4] == b"fLaC"
    songs = [sample_audio.load(p) for p in paths]
    for waveform, rate in songs:
        assert rate == 44100 and waveform.shape == (2, 21 * 4096)
        assert waveform.pow(2).mean().sqrt() > 1e-5     # above 16-bit FLAC's step: not silence
    assert not torch.equal(songs[0][0], songs[1][0])

    adapter = adapter_class("ace_step")(cfg.model, cfg.resolve)
    store = CacheStore(cache_folder(cfg.resolve(cfg.output_dir)))
    fingerprints = [store.fingerprint(p) for p in adapter.model_files()["text_encoders"]]
    cached = store.get("text", text_key(TAGS[0], fingerprints, "ace_step", None, lyrics=LYRICS))
    assert not store.has("text", text_key(TAGS[0], fingerprints, "ace_step"))   # never encoded without them
    (ours,) = adapter.sample_conditioning(cached, 1.0)
    (node,) = TextEncodeAceStepAudio.execute(adapter.load_text_encoders(), TAGS[0], LYRICS, 1.0)[0]
    torch.testing.assert_close(ours[0], node[0].float())
    assert torch.equal(ours[1]["conditioning_lyrics"], node[1]["conditioning_lyrics"].long())
    assert ours[1]["lyrics_strength"] == node[1]["lyrics_strength"] == 1.0


def test_audio_latent_is_the_nodes():
    from comfy_extras.nodes_ace import EmptyAceStepLatentAudio

    from pipetrain.backend.models.ace_step import AceStepAdapter

    latent = AceStepAdapter.audio_latent(None, 30.0)
    assert latent.shape == (1, 8, 16, int(30 * 44100 / 512 / 8)) and not latent.any()
    assert torch.equal(latent, EmptyAceStepLatentAudio.execute(30.0, 1)[0]["samples"])


def test_seconds_and_lyrics_are_checked(tmp_path):
    from pipetrain.backend.config import load_run_config
    from pipetrain.backend.errors import ConfigError
    from pipetrain.backend.preflight import check_run

    with pytest.raises(ConfigError, match="samples.seconds"):
        load_run_config(_run_config(tmp_path, "unused", seconds=0.5))
    cfg = load_run_config(_run_config(tmp_path, "unused", seconds=12.5, lyrics=LYRICS))
    assert (cfg.samples.seconds, cfg.samples.lyrics) == (12.5, LYRICS)
    config = tmp_path / "run.toml"
    config.write_text(config.read_text().replace('type = "ace_step"', 'type = "flux"'))
    with pytest.raises(ConfigError, match=r"samples\.lyrics.*ace_step|ace_step.*samples\.lyrics"):
        check_run(load_run_config(config))


def test_samples_node_sets_seconds_and_lyrics():
    from pipetrain.nodes.samples import SamplesNode

    patch = SamplesNode.execute("rock, guitar\npiano", seconds=45.0, lyrics=LYRICS).result[0]
    assert patch.table()["samples"]["seconds"] == 45.0 and patch.table()["samples"]["lyrics"] == LYRICS


def test_a_full_fine_tune_of_a_checkpoint_samples_with_the_checkpoints_vae(tmp_path):
    """No [adapter]: the samples render with the saved diffusion model, a bare file; the VAE and text encoders stay
    the checkpoint's (the saved model holds none)."""
    pytest.importorskip("torchaudio")
    import shutil

    import tomllib

    from pipetrain.backend.sampling import audio as sample_audio, render as sampling
    from pipetrain.backend.config import load_run_config
    from pipetrain.backend.models import tiny

    checkpoint = tiny.write_checkpoint("ace_step", tmp_path / "models" / "ace_step_tiny.safetensors")
    saved = tiny.write_model_files("ace_step", tmp_path / "split", "tiny").diffusion_model   # as a run saves it
    config = _run_config(tmp_path, checkpoint, prompts=TAGS[:1])
    table = tomllib.loads(config.read_text())
    del table["adapter"]
    config.write_text(tomli_w.dumps(table))
    model = shutil.copy(saved, tmp_path / "run-epoch0001.safetensors")
    (path,) = sampling.render(load_run_config(config), model)
    waveform, rate = sample_audio.load(path)
    assert path.name == "run-epoch0001-sample00.flac" and waveform.shape == (2, 21 * 4096)


def test_host_rendered_songs_are_previewed_as_audio(tmp_path, monkeypatch):
    """render_on host ComfyUI: the Epoch Samples node reads the songs back (as LoadAudio) and previews them with
    ComfyUI's audio preview; its IMAGE output is a placeholder picture."""
    import math
    from types import SimpleNamespace

    import folder_paths

    import pipetrain.backend.sampling.render as sampling
    import pipetrain.launcher.comfy as comfy_launcher
    import pipetrain.launcher.samples as samples
    from pipetrain.backend.sampling import audio as sample_audio
    from pipetrain.nodes.samples import EpochSamplesNode

    t = torch.arange(22050) / 44100
    paths = []
    for i, pitch in enumerate((220, 330)):
        paths.append(tmp_path / f"run-epoch0001-sample{i:02d}.flac")
        wave = (0.5 * torch.sin(2 * math.pi * pitch * t)).expand(1, 2, -1)
        sample_audio.save({"waveform": wave, "sample_rate": 44100}, paths[-1])
    songs = samples.load_songs(paths)
    assert songs["sample_rate"] == 44100 and songs["waveform"].shape == (2, 2, 22050)
    torch.testing.assert_close(songs["waveform"][1, 0], 0.5 * torch.sin(2 * math.pi * 330 * t), atol=1e-4, rtol=0)
    # the request answered by rendering (here: the files above); ComfyUI sets a node's hidden inputs as it runs it
    monkeypatch.setattr(sampling, "fulfil", lambda request, renderer: paths)
    monkeypatch.setattr(samples, "request_file", lambda dirs, run_id, request: tmp_path / "request.json")
    monkeypatch.setattr(comfy_launcher, "get_launcher", lambda: SimpleNamespace(dirs=None))
    monkeypatch.setattr(EpochSamplesNode, "hidden", SimpleNamespace(prompt=None, extra_pnginfo=None), raising=False)
    monkeypatch.setattr(folder_paths, "temp_directory", str(tmp_path / "temp"))   # the preview's files
    out = EpochSamplesNode.execute("run", "run-epoch0001")
    assert out.result[0].shape == (1, 8, 8, 3)
    shown = out.ui.as_dict()
    assert len(shown["audio"]) == 2 and all(a["filename"].endswith(".flac") for a in shown["audio"])
    assert len(list((tmp_path / "temp").glob("*.flac"))) == 2
