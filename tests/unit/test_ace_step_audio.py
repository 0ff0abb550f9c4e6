# SPDX-License-Identifier: GPL-3.0-or-later
"""ACE-Step's audio side: a wav written here is probed, bucketed by duration, read as ComfyUI's LoadAudio reads it
and encoded by ComfyUI's music DCAE (a tiny one, its widths in the file's metadata) into the latent
EmptyAceStepLatentAudio would give for that length; tags + lyrics encode as TextEncodeAceStepAudio does."""
import math
import wave

import pytest
import torch

from pipetrain.backend.host.runtime import ensure_comfyui

ensure_comfyui()


def _write_wav(path, seconds: float, rate: int = 22050, channels: int = 1):
    n = int(seconds * rate)
    frames = bytearray()
    for i in range(n):
        v = int(12000 * math.sin(2 * math.pi * 440 * i / rate))
        frames += v.to_bytes(2, "little", signed=True) * channels
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(bytes(frames))


def test_duration_buckets_and_lyrics(tmp_path):
    from pipetrain.backend.data.audio import audio_bucket, probe_seconds, read_lyrics

    song = tmp_path / "song.wav"
    _write_wav(song, 2.5)
    assert probe_seconds(song) == pytest.approx(2.5, abs=1e-3)
    assert audio_bucket(2.5) == (2, 1) and audio_bucket(31) == (30, 1) and audio_bucket(0.5) is None
    assert audio_bucket(1000) == (240, 1)
    assert read_lyrics(song) == ""
    (tmp_path / "song.lyrics.txt").write_text("[verse]\nla la la\n")
    assert read_lyrics(song) == "[verse]\nla la la"
    (tmp_path / "bad.wav").write_bytes(b"not audio")
    assert isinstance(probe_seconds(tmp_path / "bad.wav"), str)


def test_lyrics_are_read_only_from_a_regular_file_of_bounded_size(tmp_path):
    """A dataset folder is the workflow's choice: lyrics that are a FIFO (the scan would wait for ever) or /dev/zero
    (it would fill memory) are refused naming the file."""
    import os
    import threading

    from pipetrain.backend.data.audio import read_lyrics
    from pipetrain.backend.errors import DatasetError

    os.mkfifo(tmp_path / "fifo.lyrics.txt")
    (tmp_path / "zero.lyrics.txt").symlink_to("/dev/zero")
    (tmp_path / "long.lyrics.txt").write_bytes(b"la " * 1_000_000)
    for stem, problem in (("fifo", "not a regular file"), ("zero", "not a regular file"), ("long", "larger than")):
        raised = []

        def read():
            try:
                read_lyrics(tmp_path / f"{stem}.wav")
            except DatasetError as e:
                raised.append(str(e))
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(10)
        assert raised and raised[0].startswith(f"{tmp_path / stem}.lyrics.txt: {problem}"), (stem, raised)


@pytest.fixture(scope="module")
def ace_files(tmp_path_factory):
    from pipetrain.backend.models import tiny

    pytest.importorskip("torchaudio")   # ComfyUI's ACE VAE builds its mel filter bank with torchaudio
    return tiny.write_model_files("ace_step", tmp_path_factory.mktemp("ace"), "tiny")


def test_tiny_wav_caches_to_the_latent_comfyui_makes(tmp_path, ace_files):
    """22.05 kHz mono, 2 s: resampled to 44.1 kHz (VAEEncodeAudio), duplicated to stereo; ComfyUI pads 88200
    samples to 90112 (22 x 4096), its mel transform (n_fft 2048, hop 512, no centring) gives 173 frames and the
    DCAE's 8x makes 21 latent frames of [8, 16]."""
    from pipetrain.backend.config import ModelConfig
    from pipetrain.backend.data.audio import load_clip
    from pipetrain.backend.models import loading
    from pipetrain.backend.models.ace_step import AceStepAdapter

    song = tmp_path / "song.wav"
    _write_wav(song, 2.4)
    waveform, rate = load_clip(song, 2)
    assert rate == 22050 and waveform.shape == (1, 44100)
    vae = loading.load_vae(ace_files.vae, arch="ace_step")
    assert type(vae.first_stage_model).__name__ == "MusicDCAE" and vae.latent_channels == 8
    assert vae.first_stage_model.dcae.encoder.conv_in.out_channels == 8   # the tiny widths from the metadata
    adapter = AceStepAdapter(ModelConfig(type="ace_step", diffusion_model=str(ace_files.diffusion_model),
                                         vae=str(ace_files.vae)))
    latent = adapter.encode_audio(vae, waveform, rate)
    assert latent.shape == (8, 16, ((22 * 4096 - 2048) // 512 + 1) // 8) and torch.isfinite(latent).all()
    # the same as ComfyUI's VAEEncodeAudio node on the same audio (made stereo, as the DCAE reads two channels)
    from comfy_extras.nodes_audio import VAEEncodeAudio

    ref = VAEEncodeAudio().encode(vae, {"waveform": waveform.expand(2, -1)[None], "sample_rate": rate})[0]["samples"]
    torch.testing.assert_close(latent, ref[0].float())


def test_tags_and_lyrics_encode_as_comfyui_node(ace_files):
    from comfy_extras.nodes_ace import TextEncodeAceStepAudio

    from pipetrain.backend.config import ModelConfig
    from pipetrain.backend.models import loading
    from pipetrain.backend.models.ace_step import AceStepAdapter

    clip = loading.load_text_encoders(ace_files.text_encoders, "ace_step", torch.float32)
    adapter = AceStepAdapter(ModelConfig(type="ace_step", diffusion_model="unused", vae="unused"))
    ours = adapter.encode_song(clip, "rock, guitar", "[verse]\nhello world")
    cond = TextEncodeAceStepAudio.execute(clip, "rock, guitar", "[verse]\nhello world", 1.0)[0]
    torch.testing.assert_close(ours["cond"], cond[0][0][0].float())
    assert torch.equal(ours["lyrics"], cond[0][1]["conditioning_lyrics"][0].long())
    assert ours["cond"].shape[-1] == 768 and ours["lyrics"].shape[0] > 3
    assert not torch.equal(adapter.encode_song(clip, "rock, guitar", "")["lyrics"], ours["lyrics"])


def test_audio_dataset_scan_and_cache_keys_follow_the_audio_and_lyrics(tmp_path):
    """The scan pairs each audio file with its tags and lyrics and buckets it by duration; the text key changes with
    the lyrics (and not for a song without lyrics vs empty ones), the latent key with the audio bytes."""
    from pipetrain.backend.cache.manifest import build_entries
    from pipetrain.backend.config import DatasetConfig, DirectoryConfig, ModelConfig
    from pipetrain.backend.data.audio import audio_examples, scan_audio
    from pipetrain.backend.models.ace_step import AceStepAdapter

    songs = tmp_path / "songs"
    songs.mkdir()
    _write_wav(songs / "a.wav", 2.2)
    _write_wav(songs / "b.wav", 5.5)
    _write_wav(songs / "short.wav", 0.5)
    (songs / "a.txt").write_text("rock, guitar")
    (songs / "b.txt").write_text("rock, guitar")
    (songs / "b.lyrics.txt").write_text("[verse]\nhello")
    (songs / "notes.md").write_text("not audio")
    cfg = DatasetConfig(directory=[DirectoryConfig(str(songs))])
    scan = scan_audio(cfg)
    assert [(i.path.name, i.caption, i.lyrics) for i in scan.items] == [
        ("a.wav", "rock, guitar", ""), ("b.wav", "rock, guitar", "[verse]\nhello"), ("short.wav", "", "")]
    assert [p.name for p in scan.missing_captions] == ["short.wav"]
    samples = audio_examples(scan.items)
    assert [(s.item.path.name, s.bucket) for s in samples] == [("a.wav", (2, 1)), ("b.wav", (5, 1))]
    adapter = AceStepAdapter(ModelConfig(type="ace_step", diffusion_model="unused", vae="unused"))
    files = {"vae": [tmp_path / "vae"], "text_encoders": [tmp_path / "te"]}

    def entries():
        return build_entries(audio_examples(scan_audio(cfg).items), adapter, files, fingerprint=str)
    a, b = entries()
    assert a.text != b.text and b.lyrics == "[verse]\nhello" and a.lyrics == ""
    (songs / "a.lyrics.txt").write_text("")            # empty lyrics: the same as none (instrumental)
    assert entries()[0].text == a.text
    (songs / "b.lyrics.txt").write_text("[verse]\nhello again")
    assert entries()[1].text != b.text and entries()[1].latent == b.latent
    _write_wav(songs / "b.wav", 5.5, rate=16000)        # other audio bytes, same length
    assert entries()[1].latent != b.latent


def test_tiny_ace_step_diffusion_model_loads_through_comfyui(ace_files):
    """Through ComfyUI's load_diffusion_model with the config in the file's metadata; the lyric Conformer ComfyUI
    fixes at 1024 x 6 blocks is built narrowed (64 wide, one block) as the file holds it, and the model samples
    with ComfyUI's ACE-Step settings."""
    from pipetrain.backend.models import loading

    patcher = loading.load_diffusion_model(ace_files.diffusion_model, torch.float32, arch="ace_step")
    model = patcher.model
    assert type(model).__name__ == "ACEStep"
    assert model.diffusion_model.lyric_encoder.output_size == 64 and len(model.diffusion_model.lyric_encoder.encoders) == 1
    assert model.diffusion_model.lyric_embs.num_embeddings == 6693
    assert model.model_sampling.shift == pytest.approx(3.0) and model.model_sampling.multiplier == 1000.0
