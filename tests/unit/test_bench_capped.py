"""bench/capped.py, the capped races of issue #39: the cap reaches every Python process of both trainers the same
way, diffusion-pipe runs its example config with only paths and the step count changed, and PipeTrain's config
keeps what a user would keep from it. (The figures come from the GPU machine; these checks cost seconds.)"""
import json
import os
import subprocess
import sys
import tomllib

# an example in the shape of diffusion-pipe's low-memory configs (values of our own)
EXAMPLE = """
output_dir = '/somewhere/runs'
dataset = '/somewhere/dataset.toml'
epochs = 50
micro_batch_size_per_gpu = 1
gradient_accumulation_steps = 3
gradient_clipping = 1
save_every_n_epochs = 2
activation_checkpointing = 'unsloth'
blocks_to_swap = 20
caching_batch_size = 2

[model]
type = 'wan'
ckpt_path = '/models/wan'
dtype = 'bfloat16'
transformer_dtype = 'float8'
timestep_sample_method = 'logit_normal'

[adapter]
type = 'lora'
rank = 16
dtype = 'bfloat16'

[optimizer]
type = 'AdamW8bitKahan'
lr = 3e-5
betas = [0.9, 0.99]
weight_decay = 0.01
stabilize = false
"""
WRITTEN = {"output_dir": "/data/out", "dataset": "/data/dataset.toml", "epochs": 1000, "max_steps": 8,
           "save_every_n_epochs": 1000, "activation_checkpointing": True, "gradient_accumulation_steps": 1,
           "model": {"type": "wan", "ckpt_path": "/data/wan-dp-full", "transformer_path": "/data/wan.safetensors",
                     "llm_path": "/data/umt5.safetensors", "dtype": "bfloat16"},
           "optimizer": {"type": "adamw", "lr": 1e-4}}


def test_diffusion_pipe_runs_its_example_with_only_paths_and_the_step_count_changed():
    from pipetrain.bench.capped import dp_config

    example = tomllib.loads(EXAMPLE)
    config = dp_config(example, WRITTEN)
    changed = {k for k in config if config[k] != example.get(k)}
    assert changed == {"output_dir", "dataset", "epochs", "max_steps", "save_every_n_epochs", "model"}
    assert (config["max_steps"], config["save_every_n_epochs"]) == (8, 1000)
    # the example's settings stay: checkpointing, swap, accumulation, optimizer, float8 weights
    assert (config["activation_checkpointing"], config["blocks_to_swap"], config["gradient_accumulation_steps"]) == \
        ("unsloth", 20, 3)
    assert config["optimizer"] == example["optimizer"]
    assert config["model"] == {"type": "wan", "ckpt_path": "/data/wan-dp-full", "dtype": "bfloat16",
                               "transformer_dtype": "float8", "timestep_sample_method": "logit_normal",
                               "transformer_path": "/data/wan.safetensors", "llm_path": "/data/umt5.safetensors"}


def test_pipetrain_keeps_the_users_choices_from_the_same_config_and_plans_its_memory_at_the_cap():
    from pipetrain.bench.capped import ours_keys

    keys = ours_keys(tomllib.loads(EXAMPLE), 16.0)
    assert keys == {"gradient_accumulation_steps": 3, "gradient_clipping": 1, "memory": "auto",
                    "memory_limit_gib": 16.0,
                    # 'stabilize' is diffusion-pipe's own argument (False: its default), which our class lacks
                    "optimizer": {"type": "AdamW8bitKahan", "lr": 3e-5, "betas": [0.9, 0.99], "weight_decay": 0.01},
                    "adapter": {"rank": 16, "alpha": 16.0, "dtype": "bfloat16"},
                    "model": {"diffusion_model_dtype": "float8"}}


def test_the_flux_race_tries_diffusion_pipes_settings_in_order_over_its_bench_defaults():
    from pipetrain.bench.capped import DP_DEFAULTS, RACES, dp_settings

    first, second = dp_settings(RACES["flux-1024"], None)
    assert first["model"] == {"transformer_dtype": "float8"} and first["activation_checkpointing"] is True
    assert (second["activation_checkpointing"], second["blocks_to_swap"]) == ("unsloth", 12)
    assert first["optimizer"] == second["optimizer"] == DP_DEFAULTS["optimizer"]


def test_set_ours_rewrites_the_run_toml_that_pipetrains_loader_then_accepts(tmp_path):
    """run.py's run.toml for the race, rewritten with the race's keys, passes PipeTrain's own validation."""
    import tomli_w

    from pipetrain.backend.config import load_run_config
    from pipetrain.bench.capped import ours_keys, set_ours

    (tmp_path / "dataset").mkdir()
    (tmp_path / "dataset.toml").write_text(tomli_w.dumps(
        {"resolutions": [64], "directory": [{"path": str(tmp_path / "dataset"), "num_repeats": 1}]}))
    run = {"output_dir": str(tmp_path / "out"), "dataset": str(tmp_path / "dataset.toml"), "epochs": 1,
           "activation_checkpointing": True, "activation_checkpointing_fraction": 1.0,
           "model": {"type": "wan", "diffusion_model": "/m/w.safetensors", "vae": "/m/v.safetensors",
                     "text_encoders": ["/m/t.safetensors"], "dtype": "bfloat16"},
           "optimizer": {"type": "adamw", "lr": 1e-4}, "adapter": {"rank": 32, "alpha": 32.0}}
    (tmp_path / "run.toml").write_text(tomli_w.dumps(run))
    example = tomllib.loads(EXAMPLE)
    example["optimizer"] = {"type": "automagic", "weight_decay": 0.01}
    set_ours(tmp_path / "run.toml", ours_keys(example, 24.0))
    cfg = load_run_config(tmp_path / "run.toml", check_dataset=False)
    assert (cfg.memory, cfg.memory_limit_gib, cfg.gradient_accumulation_steps) == ("auto", 24.0, 3)
    assert cfg.model.diffusion_model_dtype == "float8" and cfg.model.diffusion_model == "/m/w.safetensors"
    written = tomllib.loads((tmp_path / "run.toml").read_text())
    assert written["optimizer"] == {"type": "automagic", "weight_decay": 0.01}   # no lr left from run.py's
    assert "activation_checkpointing" not in written


def test_the_cap_is_queued_for_cudas_initialisation_in_every_python_process_it_reaches(tmp_path, monkeypatch):
    """A child started with the cap's environment (as both trainers' launchers and ranks are) has the cap queued
    for CUDA's lazy initialisation once torch is imported, and still runs the sitecustomize it shadows; one without
    the cap's variable gets nothing."""
    from pipetrain.bench.capped import CAP_ENV, CAP_HOOK_NAME, cap_env, cap_site

    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['SHADOWED_SITECUSTOMIZE_RAN'] = '1'\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(other), os.environ.get("PYTHONPATH")])))
    env = {**os.environ, **cap_env(cap_site(tmp_path / "site"), 16, tmp_path / "cap.log")}
    probe = ("import os, json, torch.cuda as c; print(json.dumps([[getattr(f, '__name__', '') for f, _ in "
             "c._queued_calls], os.environ.get('SHADOWED_SITECUSTOMIZE_RAN')]))")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    queued, shadowed = json.loads(out.stdout.strip().splitlines()[-1])
    assert CAP_HOOK_NAME in queued and shadowed == "1", out.stderr[-2000:]
    assert env[CAP_ENV] == "16" and env["PYTHONPATH"].split(os.pathsep)[:2] == [str(tmp_path / "site"), str(other)]

    del env[CAP_ENV]
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    queued, shadowed = json.loads(out.stdout.strip().splitlines()[-1])
    assert CAP_HOOK_NAME not in queued and shadowed == "1"


def test_diffusion_pipes_samples_per_second_count_every_accumulated_micro_batch():
    """The qwen_image example accumulates 4 micro-batches per optimizer step: a 2 s step is 2 samples/s."""
    from dataclasses import replace

    from pipetrain.bench.diffusion_pipe import summarise
    from pipetrain.bench.run import CASES

    case = replace(CASES["qwen_image-1024-ckpt"], gradient_accumulation=4)
    steps = [{"type": "step", "step_s": 2.0, "peak_alloc_gib": 20.0, "peak_reserved_gib": 21.0}] * 3
    assert summarise(case, steps, "", warmup=1)["samples_per_s"] == 2.0


def test_set_dp_keeps_the_harness_keys_under_settings_without_an_example_and_repeats_for_every_sample(tmp_path):
    """Settings tried without a shipped example (Flux) go over diffusion_pipe.py's own config, whose micro-batch,
    printing and caching keys stay; the dataset holds every timed sample in one epoch."""
    import tomli_w

    from pipetrain.bench.capped import RACES, dp_settings, set_dp

    (tmp_path / "dataset").mkdir()
    for i in range(8):
        (tmp_path / "dataset" / f"img{i}.png").write_bytes(b"")
        (tmp_path / "dataset" / f"img{i}.txt").write_text("x")
    (tmp_path / "dataset.toml").write_text(f'resolutions = [64]\n\n[[directory]]\npath = "{tmp_path / "dataset"}"\n'
                                           "num_repeats = 2\n")
    written = {**WRITTEN, "micro_batch_size_per_gpu": 1, "steps_per_print": 1, "caching_batch_size": 1,
               "model": {"type": "flux", "diffusers_path": "/data/flux-dp-full", "dtype": "bfloat16",
                         "transformer_dtype": "bfloat16"}}
    (tmp_path / "main.toml").write_text(tomli_w.dumps(written))
    _, swapped = dp_settings(RACES["flux-1024"], None)
    set_dp(tmp_path, swapped, samples=44, shipped=False)
    main = tomllib.loads((tmp_path / "main.toml").read_text())
    assert (main["micro_batch_size_per_gpu"], main["steps_per_print"], main["caching_batch_size"]) == (1, 1, 1)
    assert (main["activation_checkpointing"], main["blocks_to_swap"]) == ("unsloth", 12)
    assert main["model"] == {**written["model"], "transformer_dtype": "float8"}
    assert "num_repeats = 6" in (tmp_path / "dataset.toml").read_text()      # 6 x 8 pictures >= 44 samples
