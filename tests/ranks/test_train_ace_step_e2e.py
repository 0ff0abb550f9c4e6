# SPDX-License-Identifier: GPL-3.0-or-later
"""ACE-Step end to end on the CPU: generated wavs (tags, lyrics on some) -> cache (UMT5-base + lyric tokens, the
tiny music DCAE) -> 2 epochs with 2 DeepSpeed ranks as a 2-stage pipeline, micro-batches of 2 whose tags and lyrics
differ in length -> epoch LoRAs loaded by ComfyUI's LoraLoaderModelOnly, reproducing the training-side output.
Then the same from ComfyUI's all-in-one checkpoint alone, with epoch samples rendered as songs (FLAC)."""
import math
import wave

import pytest
from conftest import check_epoch_loras, train

pytestmark = pytest.mark.slow
pytest.importorskip("torchaudio")   # ComfyUI's ACE VAE needs it


def _wav(path, seconds: float, pitch: float, rate: int = 22050):
    frames = bytearray()
    for i in range(int(seconds * rate)):
        frames += int(10000 * math.sin(2 * math.pi * pitch * i / rate)).to_bytes(2, "little", signed=True) * 2
    with wave.open(str(path), "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(bytes(frames))


def test_two_stage_pipeline_to_comfyui_lora(model_files, make_run):
    config = make_run(model_files("ace_step"), images=1, stages=2, epochs=2, micro_batch_size_per_gpu=2,
                      model={"type": "ace_step"}, optimizer={"lr": 3e-2})
    dataset = config.parent / "dataset"
    for p in dataset.iterdir():
        p.unlink()
    for i in range(4):    # 2.2 s clips: the 2 s bucket, 21 latent frames
        _wav(dataset / f"song{i}.wav", 2.2, 220 * (i + 1))
        (dataset / f"song{i}.txt").write_text("piano" if i % 2 else "rock, electric guitar, drums, upbeat")
    (dataset / "song0.lyrics.txt").write_text("[verse]\nhello hello\n\n[chorus]\nla la la")
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    assert run.status()["state"] == "finished"
    cached = run.events("cached")[0]
    assert cached["entries"] == 4 and cached["latents_encoded"] == 4 and cached["texts_encoded"] >= 3
    engine = run.events("engine")[0]
    assert engine["steps_per_epoch"] == 2
    assert [e["epoch"] for e in run.events("lora_saved")] == [1, 2]
    # 8 attention projections in each of the 2 blocks; the first epoch's 2 steps barely move the LoRA
    check_epoch_loras(run, config, keys=16, last_only=True)


def test_all_in_one_checkpoint_trains_and_renders_songs(tmp_path, make_run):
    """[model] names ComfyUI's all-in-one checkpoint alone (its VAE and text encoders read from it): 2 ranks, 2
    stages, 1 epoch; the epoch's samples are FLAC songs of [samples] seconds beside the LoRA, announced, listed with
    the epoch and served by the panel's sample lookup (the ``/pipetrain/runs/{id}/samples/{name}`` route's)."""
    import mimetypes

    import tomli_w
    import tomllib

    from pipetrain.backend.sampling import audio as sample_audio
    from pipetrain.backend.models import tiny
    from pipetrain.backend.run.folder import RunsRoot
    from pipetrain.launcher.summaries import sample_file, saved_loras

    checkpoint = tiny.write_checkpoint("ace_step", tmp_path / "models" / "ace_step_tiny.safetensors")
    config = make_run(tiny.ModelFiles(checkpoint, checkpoint, []), images=1, stages=2, epochs=1,
                      micro_batch_size_per_gpu=2, model={"type": "ace_step"}, optimizer={"lr": 3e-2},
                      samples={"prompts": ["rock, guitar", "piano"], "seconds": 1.5, "steps": 2,
                               "lyrics": "[verse]\nla la"})
    table = tomllib.loads(config.read_text())
    del table["model"]["vae"]    # the checkpoint's own VAE and text encoders
    table["model"]["text_encoders"] = []
    config.write_text(tomli_w.dumps(table))
    dataset = config.parent / "dataset"
    for p in dataset.iterdir():
        p.unlink()
    for i in range(4):
        _wav(dataset / f"song{i}.wav", 2.2, 220 * (i + 1))
        (dataset / f"song{i}.txt").write_text("piano" if i % 2 else "rock, electric guitar")
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    assert run.events("cached")[0]["latents_encoded"] == 4
    saved = run.events("sample_saved")
    assert [e["prompt"] for e in saved] == ["rock, guitar", "piano"]
    for e in saved:
        waveform, rate = sample_audio.load(e["path"])
        # int(1.5 x 44100 / 4096) = 16 latent frames of 4096 samples
        assert rate == 44100 and waveform.shape == (2, 16 * 4096) and waveform.pow(2).mean().sqrt() > 1e-5
    (epoch,) = saved_loras(run.run_dir)
    assert [s["path"] for s in epoch["samples"]] == [e["path"] for e in saved]
    runs = RunsRoot(run.run_dir.parent)
    name = epoch["samples"][0]["name"]
    assert name.endswith(".flac") and str(sample_file(runs, run.run_dir.name, name)) == saved[0]["path"]
    assert mimetypes.guess_type(name)[0] in ("audio/flac", "audio/x-flac")
