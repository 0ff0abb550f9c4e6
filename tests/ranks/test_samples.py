"""Sample images for every saved epoch LoRA, rendered by ComfyUI's sampler with the fresh LoRA: PNGs
beside the LoRA, announced in events.jsonl and TensorBoard, different between epochs."""
import numpy as np
import pytest
from conftest import train
from PIL import Image

pytestmark = pytest.mark.slow


def test_each_epoch_gets_sample_images(micro_flux_files, make_run):
    samples = {"prompts": ["a red circle", "a blue square"], "seed": 3, "width": 64, "height": 64, "steps": 3}
    config = make_run(micro_flux_files, images=2, stages=2, epochs=2, samples=samples,
                      optimizer={"type": "adamw", "lr": 2e-2})
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    announced = run.events("sample_saved")
    assert [(e["epoch"], e["prompt"]) for e in announced] == [
        (1, "a red circle"), (1, "a blue square"), (2, "a red circle"), (2, "a blue square")]
    loras = run.loras()
    for e in announced:
        png = Image.open(e["path"])
        assert png.size == (64, 64)
        assert e["path"].startswith(str(loras[e["epoch"] - 1].with_suffix("")))
    first = np.asarray(Image.open(announced[0]["path"]), dtype=np.int16)
    second = np.asarray(Image.open(announced[2]["path"]), dtype=np.int16)
    assert np.abs(first - second).max() > 0          # same prompt and seed, another epoch's LoRA
    assert list((run.run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_samples_at_several_lora_strengths_form_the_panels_grid(micro_flux_files, make_run):
    """Each prompt at each strength, strength after strength; the run's summary gives each sample its strength
    and prompt (the panel's epoch x strength x prompt grid); weaker LoRA, another image."""
    from pipetrain.launcher.summaries import saved_loras

    samples = {"prompts": ["a red circle", "a blue square"], "seed": 3, "width": 64, "height": 64, "steps": 3,
               "strengths": [0.5, 1.0]}
    config = make_run(micro_flux_files, images=2, stages=2, epochs=1, samples=samples,
                      optimizer={"type": "adamw", "lr": 5e-2})
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    announced = run.events("sample_saved")
    assert [(e["strength"], e["prompt_index"], e["prompt"]) for e in announced] == [
        (0.5, 0, "a red circle"), (0.5, 1, "a blue square"), (1.0, 0, "a red circle"), (1.0, 1, "a blue square")]
    assert [e["path"].rsplit("-", 1)[-1] for e in announced] == ["x0.50.png", "x0.50.png", "x1.00.png", "x1.00.png"]
    half, full = (np.asarray(Image.open(announced[i]["path"]), dtype=np.int16) for i in (0, 2))
    assert np.abs(half - full).max() > 0
    [lora] = saved_loras(run.run_dir)
    assert sorted((s["strength"], s["prompt_index"]) for s in lora["samples"]) == [(0.5, 0), (0.5, 1), (1.0, 0),
                                                                                   (1.0, 1)]


def test_a_video_models_samples_are_clips_of_the_asked_frames(model_files, tmp_path):
    """Wan (t2v) on clips: each epoch sample is an animated WebP of [samples] frames at its fps, rendered through
    ComfyUI's sampler and Wan VAE, named as the stills are."""
    from media import make_video_dataset
    from pipetrain.backend.commands.demo import write_configs

    root = tmp_path / "job"
    make_video_dataset(root / "dataset")
    samples = {"prompts": ["a red square moving"], "seed": 3, "width": 64, "height": 64, "steps": 2, "frames": 9,
               "fps": 8.0}
    config = write_configs(root, model_files("wan"), stages=2, epochs=1, model={"type": "wan"}, samples=samples)
    with open(root / "dataset.toml", "a") as f:   # lands in the [[directory]] table
        f.write("frame_buckets = [1, 9]\n")
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    [announced] = run.events("sample_saved")
    [lora] = run.loras()
    assert announced["path"] == str(lora.with_suffix("")) + "-sample00.webp"
    with Image.open(announced["path"]) as clip:
        assert (clip.format, clip.n_frames, clip.size) == ("WEBP", 9, (64, 64))
        clip.seek(8)
        clip.load()
        assert clip.info["duration"] == 125
