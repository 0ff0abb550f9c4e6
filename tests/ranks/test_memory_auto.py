# SPDX-License-Identifier: GPL-3.0-or-later
"""``memory = "auto"`` in a real 2-rank pipeline run: given a memory limit that the run's plan says holds it only
with checkpointing, the run checkpoints, says so in its events, and trains."""
import pytest

from tests.conftest import train

RESOLUTION = 192   # square, no aspect buckets: the run traces the very latent size the limit is computed for


def _square(config):
    import tomli_w
    import tomllib

    dataset = config.parent / "dataset.toml"
    data = tomllib.loads(dataset.read_text())
    data.update(resolutions=[RESOLUTION], enable_ar_bucket=False)
    dataset.write_text(tomli_w.dumps(data))
    return config

pytestmark = pytest.mark.slow


def _gib_between_no_checkpointing_and_full(config) -> float:
    """A limit halfway between what the plan gives the run without checkpointing and with every block
    checkpointed, traced on the run's own cached micro-batch exactly as the trainer traces it."""
    from pipetrain.backend.memory import plan as mp
    from pipetrain.backend.cache import CacheStore
    from pipetrain.backend.cache.manifest import CacheManifest, manifest_path
    from pipetrain.backend.config import load_run_config
    from pipetrain.backend.run.folder import cache_folder
    from pipetrain.backend.train.memory_auto import largest_entry, planning_inputs
    from pipetrain.backend.train.parts import CachedData

    cfg = load_run_config(config)
    store = CacheStore(cache_folder(cfg.resolve(cfg.output_dir)))
    entries = CacheManifest.load(manifest_path(store.root, cfg.resolve(cfg.dataset), "flux")).entries
    data = CachedData(store, entries, {})
    footprints = mp.trace_run(cfg, planning_inputs(cfg, data, largest_entry(data)))
    training = mp.training_of(cfg)
    none = max(st.gpu for st in mp.estimate(footprints, mp.MemorySettings(), training))
    full = max(st.gpu for st in mp.estimate(footprints, mp.MemorySettings(True), training))
    assert full < 0.95 * none, (full, none, "checkpointing must matter at this size for the test to mean anything")
    return (none + full) / 2 / mp.HEADROOM / mp.GIB


def _with_keys(config, **keys):
    import tomli_w
    import tomllib

    data = tomllib.loads(config.read_text())
    data.update(keys)
    config.write_text(tomli_w.dumps(data))
    return config


def test_auto_checkpoints_where_the_limit_needs_it_and_trains(micro_flux_files, make_run):
    config = _square(make_run(micro_flux_files, images=4, epochs=1))
    cached = train(config, 1, "--cache-only")
    assert cached.returncode == 0, cached.output[-3000:]
    limit = _gib_between_no_checkpointing_and_full(config)
    run = train(_with_keys(config, memory="auto", memory_limit_gib=limit), 2)
    assert run.returncode == 0, run.output[-3000:]
    [plan] = run.events("memory_plan")
    assert plan["chosen"]["activation_checkpointing"] is not False, plan
    assert "stage 1:" in plan["message"]
    [engine] = run.events("engine")
    assert engine["checkpointed_layers"] > 0
    assert run.losses() and len(run.loras()) == 1
    # what the Train and Run Status nodes show
    from pipetrain.launcher.summaries import summarize
    from pipetrain.backend.run.folder import RunsRoot
    from pipetrain.nodes.runs import status_text
    text = status_text(summarize(RunsRoot(run.output_dir), run.run_dir.name, False))
    assert "memory auto: activation_checkpointing = " in text and "planned" in text, text
    # a limit nothing fits: refused before the model loads, naming the key and what to change
    refused = train(_with_keys(config, memory_limit_gib=limit / 100), 2)
    assert refused.returncode != 0 and "key 'memory'" in refused.output and "pipeline_stages" in refused.output


def test_auto_without_gpu_or_limit_trains_with_the_configs_settings(micro_flux_files, make_run):
    config = make_run(micro_flux_files, images=2, epochs=1, memory="auto")
    run = train(config, 2)
    assert run.returncode == 0, run.output[-3000:]
    [plan] = run.events("memory_plan")
    assert plan["chosen"] is None and "nothing to plan for" in plan["reason"]
    [engine] = run.events("engine")
    assert engine["checkpointed_layers"] == 0
