"""The options end to end with real DeepSpeed ranks on the micro Flux; each assertion fails if its option
is ignored: an examples/ config pair trains as is (paths substituted); eval datasets log per-quantile
held-out loss, identical for the same weights across pipeline layouts; warm-up shapes the logged LR;
gradient clipping bounds the update; init_from_existing starts from the given LoRA; save_every_n_steps
writes step LoRAs; caption prefix / shuffled variants / dropout reach the cache; Prodigy and 8-bit AdamW
drive the steps."""
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
import tomli_w
from conftest import eval_set, train
from safetensors.torch import load_file, save_file

from pipetrain.backend.commands.demo import make_dataset
from pipetrain.backend.train.schedule import lr_multiplier

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
QUANTILE_KEYS = [f"{q / 10:.2f}" for q in range(1, 10)]


def _set(text: str, key: str, value) -> str:
    """Replace the uncommented ``key = ...`` line (failing when the example no longer has it)."""
    line = tomli_w.dumps({key: value}).strip()
    new, n = re.subn(rf"^{key} = .*$", lambda _: line, text, count=1, flags=re.M)
    assert n == 1, f"the example has no line '{key} = ...'"
    return new


def test_examples_flux_pair_trains_as_is(micro_flux_files, tmp_path):
    root = tmp_path / "example"
    make_dataset(root / "images", 4)       # dataset.toml's [[directory]] path = 'images'
    run_text = (EXAMPLES / "flux_lora.toml").read_text()
    for key, value in [("diffusion_model", str(micro_flux_files.diffusion_model)), ("vae", str(micro_flux_files.vae)),
                       ("text_encoders", [str(p) for p in micro_flux_files.text_encoders]), ("epochs", 2)]:
        run_text = _set(run_text, key, value)
    (root / "flux_lora.toml").write_text(run_text)
    (root / "dataset.toml").write_text(_set((EXAMPLES / "dataset.toml").read_text(), "resolutions", [64]))

    run = train(root / "flux_lora.toml", ranks=1)
    assert run.returncode == 0, run.output[-4000:]
    run = dataclasses.replace(run, output_dir=root / "output" / "flux_lora")    # the example's output_dir
    assert run.status()["state"] == "finished"
    assert [e["epoch"] for e in run.events("lora_saved")] == [2]                # save_every_n_epochs = 2
    lora = load_file(str(run.loras()[-1]))
    assert {v.dtype for k, v in lora.items() if "lora_" in k} == {torch.bfloat16}   # save_dtype
    assert any(v.abs().max() > 0 for k, v in lora.items() if "lora_B" in k)
    lrs = [e["lr"] for e in run.events("step")]
    assert lrs[:3] == pytest.approx([2e-6, 4e-6, 6e-6])                        # warmup_steps = 10, lr 2e-5


def _tensorboard(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def captions_run(micro_flux_files, tmp_path_factory):
    """One rank: caption prefix, 2 shuffled variants per caption, caption dropout, Prodigy, an eval set, half the
    blocks checkpointed."""
    from pipetrain.backend.commands.demo import write_configs

    root = tmp_path_factory.mktemp("captions")
    make_dataset(root / "dataset", 4)
    config = write_configs(root, micro_flux_files, stages=1, epochs=1, checkpoint_every_n_epochs=None,
                           uncond_fraction=0.5, eval_datasets=[eval_set(root)], eval_before_first_step=True,
                           optimizer={"type": "Prodigy", "lr": 1.0, "d_coef": 2.0},
                           activation_checkpointing=True, activation_checkpointing_fraction=0.5)
    dataset = config.with_name("dataset.toml")
    dataset.write_text(dataset.read_text() + 'caption_prefix = "photo of "\ncache_shuffle_num = 2\n'
                       'cache_shuffle_delimiter = " "\n')
    run = train(config, ranks=1)
    assert run.returncode == 0, run.output[-4000:]
    return run


def test_caption_options_and_prodigy(captions_run):
    run = captions_run
    cached = run.events("cached")[0]
    # 4 images x 2 shuffled variants, each its own example; + 2 eval captions + the empty caption (dropout)
    assert (cached["entries"], cached["texts_encoded"], cached["latents_encoded"]) == (8, 8 + 2 + 1, 4 + 2)
    engine = run.events("engine")[0]
    assert engine["steps_per_epoch"] == 8
    assert engine["checkpointed_layers"] == 2      # half of the micro Flux's 2 double + 2 single blocks
    manifest = [json.loads(p.read_text()) for p in (run.output_dir / "cache" / "manifests").glob("*.json")]
    train_entries = next(m["entries"] for m in manifest if len(m["entries"]) == 8)
    by_image = {}
    for e in train_entries:
        assert e["caption"].startswith("photo of ")
        by_image.setdefault(e["path"], []).append(e["caption"][len("photo of "):])
    for path, variants in by_image.items():
        original = Path(path).with_suffix(".txt").read_text()
        assert len(variants) == 2 and all(sorted(v.split(" ")) == sorted(original.split(" ")) for v in variants)
    assert any(v != Path(p).with_suffix(".txt").read_text() for p, vs in by_image.items() for v in vs)
    d = [e["prodigy_d"] for e in run.events("step")]
    assert d[0] == pytest.approx(1e-6) and d[-1] > 10 * d[0]          # Prodigy adapts its step size


def test_eval_datasets_held_out_loss_per_quantile(micro_flux_files, make_run, captions_run, tmp_path):
    """Two pipeline stages on two ranks, 8-bit AdamW, selective activation checkpointing; evals before step 1, every
    3 steps and every epoch."""
    held = eval_set(tmp_path / "evals")
    config = make_run(micro_flux_files, images=4, name="evals", stages=2, epochs=2, checkpoint_every_n_epochs=None,
                      eval_datasets=[held], eval_every_n_steps=3, eval_every_n_epochs=1,
                      activation_checkpointing="selective",
                      optimizer={"type": "adamw8bit", "lr": 5e-3, "min_8bit_size": 16})
    run = train(config, ranks=2)
    assert run.returncode == 0, run.output[-4000:]
    # uncompiled, the policy runs eagerly: the run says so once, with the setting to use instead
    (advice,) = [e["message"] for e in run.events("warning") if "'selective'" in e["message"]]
    assert advice.endswith("set activation_checkpointing = true")
    evals = run.events("eval")
    assert [e["step"] for e in evals] == [0, 3, 4, 6, 8]     # before step 1; steps 3, 6; ends of epochs 1, 2
    for e in evals:
        assert e["name"] == "held" and list(e["quantiles"]) == QUANTILE_KEYS
        assert e["loss"] == pytest.approx(sum(e["quantiles"].values()) / 9)
    assert len({round(v, 6) for v in evals[0]["quantiles"].values()}) == 9   # each quantile is its own timestep
    assert evals[-1]["loss"] != evals[0]["loss"]                             # training moved the held-out loss
    # the same weights (the untrained LoRA) give the same eval loss on 1 rank / 1 stage as on 2 stages
    single = captions_run.events("eval")[0]
    assert single["step"] == 0 and single["loss"] == pytest.approx(evals[0]["loss"], rel=1e-5)
    for q in QUANTILE_KEYS:
        assert single["quantiles"][q] == pytest.approx(evals[0]["quantiles"][q], rel=1e-5)
    scalars = _tensorboard(run.run_dir)
    assert [s for s, _ in scalars["eval/held/loss"]] == [0, 3, 4, 6, 8]
    assert scalars["eval/held/loss_quantile_0.10"][0][1] == pytest.approx(evals[0]["quantiles"]["0.10"])
    assert len(scalars["train/grad_norm"]) == 8
    assert run.status()["eval"]["held"]["step"] == 8


def _init_lora(files, path: Path, rank: int, seed: int = 3) -> dict[str, torch.Tensor]:
    """A LoRA for the micro Flux with every A and B random (ComfyUI keys), written to ``path``."""
    from pipetrain.backend.adapters import injection
    from pipetrain.backend.config import ModelConfig
    from pipetrain.backend.models.flux import FluxAdapter
    from pipetrain.backend.host.runtime import ensure_comfyui

    ensure_comfyui()
    adapter = FluxAdapter(ModelConfig(type="flux", diffusion_model=str(files.diffusion_model), vae=str(files.vae),
                                      dtype="float32"))
    adapter.load_diffusion_model()
    injection.inject(adapter.diffusion_model, injection.AdapterSpec(rank=rank, alpha=float(rank)),
                     adapter.lora_block_prefixes)
    g = torch.Generator().manual_seed(seed)
    sd = {k: (torch.randn(v.shape, generator=g) * 0.1 if "lora_" in k else v)
          for k, v in injection.state_dict(adapter.diffusion_model).items()}
    save_file(sd, str(path))
    return sd


def _norm(a: dict, b: dict) -> float:
    return float(torch.sqrt(sum(((a[k].float() - b[k].float()) ** 2).sum() for k in a if "lora_" in k)))


def test_warmup_clipping_init_from_existing_and_step_saves(micro_flux_files, make_run, tmp_path):
    lr, clip, warmup, steps = 0.5, 1e-3, 3, 5
    init = _init_lora(micro_flux_files, tmp_path / "init.safetensors", rank=4)
    config = make_run(micro_flux_files, images=4, name="sched", stages=1, epochs=3, max_steps=steps,
                      checkpoint_every_n_epochs=None, save_every_n_steps=1, warmup_steps=warmup,
                      lr_scheduler="linear", gradient_clipping=clip, optimizer={"type": "sgd", "lr": lr},
                      adapter={"init_from_existing": str(tmp_path / "init.safetensors")})
    run = train(config, ranks=1)
    assert run.returncode == 0, run.output[-4000:]

    # warm-up: the LR each step used ramps up over warmup_steps, then decays linearly to the last step
    f = lr_multiplier("linear", warmup, steps)
    assert [e["lr"] for e in run.events("step")] == pytest.approx([lr * f(s) for s in range(steps)])
    assert [e["lr"] for e in run.events("step")][:3] == pytest.approx([lr / 3, 2 * lr / 3, lr])

    # save_every_n_steps = 1: a step LoRA after every step (beside the epoch LoRAs)
    saved = run.events("step_lora_saved")
    assert [e["step"] for e in saved] == list(range(1, steps + 1))
    first = load_file(saved[0]["path"])

    # init_from_existing: every adapted module starts from init.safetensors ...
    loaded = run.events("init_from_existing")[0]
    assert loaded["modules_loaded"] == loaded["modules"] == sum(k.endswith("lora_A.weight") for k in init)
    # ... and clipping: with SGD one step moves the weights by exactly lr_step * clip (the gradient's norm is
    # far above clip), so step 1's LoRA is that close to init.safetensors and nowhere near a fresh init
    grad_norm = run.events("step")[0]["grad_norm"]
    assert grad_norm > 10 * clip
    assert _norm(first, init) == pytest.approx(lr / warmup * clip, rel=1e-3)
