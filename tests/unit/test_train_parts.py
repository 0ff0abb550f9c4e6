"""The trainer's phases one at a time, each with exactly its inputs (``backend/train/parts.py``): the cache
phase on a real micro Flux and a real dataset returns ``CachedData``; the epoch plan and the eval sets are
built from it for a rank of a larger topology, without a process group; a restored ``RunState`` goes back
into a checkpoint unchanged."""
from __future__ import annotations

import shutil

import pytest

from pipetrain.backend.config import load_run_config
from pipetrain.backend.run.folder import RunDir
from pipetrain.backend.train.events import RunReporter
from pipetrain.backend.train.parts import CachedData, RunState, Topology


def test_topology_follows_deepspeeds_grid():
    # 8 ranks in 2 stages: ranks 0-3 hold stage 0, 4-7 stage 1; rank 6 is data-parallel rank 2 of 4
    t = Topology(rank=6, world=8, local_rank=2, pipeline_stages=2)
    assert (t.dp_world, t.dp_rank, t.is_main) == (4, 2, False)
    assert Topology(0, 1, 0).is_main and Topology(0, 1, 0).dp_world == 1


def test_run_state_is_what_a_checkpoint_keeps():
    state = RunState(global_step=12, epoch=3, step_in_epoch=2, last_saved_step=8)
    assert state.client_state(global_batch=8) == {"global_step": 12, "epoch": 3, "step_in_epoch": 2,
                                                  "global_batch": 8, "last_saved_step": 8}
    state.base_lr = 3e-5   # a learning rate set while the run trained goes into its checkpoints
    assert state.client_state(global_batch=8)["base_lr"] == 3e-5


def test_eval_due_by_steps_or_by_finished_epochs():
    from pipetrain.backend.train.eval import eval_due

    assert eval_due(4, None, 8, None) and not eval_due(4, None, 9, None)
    assert eval_due(None, 2, 9, finished_epoch=4) and not eval_due(None, 2, 9, finished_epoch=3)
    assert not eval_due(None, 2, 9, finished_epoch=None) and not eval_due(None, None, 9, finished_epoch=2)


@pytest.fixture(scope="module")
def cached(micro_flux_files, tmp_path_factory):
    """The cache phase alone: a real adapter, a real dataset of 4 images plus a 4-image eval dataset, rank 0 of
    one process (the collectives pass through without a process group)."""
    from pipetrain.backend.commands.demo import make_dataset, write_configs
    from pipetrain.backend.models.registry import adapter_class
    from pipetrain.backend.train.caching import prepare_cache

    root = tmp_path_factory.mktemp("parts")
    make_dataset(root / "dataset", 4)
    make_dataset(root / "held_out", 4)
    write_configs(root, micro_flux_files)
    (root / "eval.toml").write_text((root / "dataset.toml").read_text().replace(str(root / "dataset"),
                                                                                  str(root / "held_out")))
    config = write_configs(root, micro_flux_files, eval_datasets=[{"name": "held", "config": str(root / "eval.toml")}],
                           uncond_fraction=0.5)
    cfg = load_run_config(config)
    report = RunDir(root / "report")
    report.path.mkdir()
    adapter = adapter_class(cfg.model.type)(cfg.model, cfg.resolve)
    data = prepare_cache(cfg, adapter, Topology(0, 1, 0, cfg.pipeline_stages), RunReporter(report, enabled=True))
    yield cfg, adapter, data, report
    shutil.rmtree(root, ignore_errors=True)


def test_the_cache_phase_returns_its_part(cached):
    cfg, adapter, data, report = cached
    assert isinstance(data, CachedData)
    assert len(data.entries) == 4 and list(data.eval_entries) == ["held"] and len(data.eval_entries["held"]) == 4
    assert all(data.store.has("latents", e.latent) and data.store.has("text", e.text) for e in data.entries)
    # caption dropout: every training caption has the empty caption's key, itself encoded
    assert set(data.uncond_text) == {e.text for e in data.entries}
    assert all(data.store.has("text", key) for key in data.uncond_text.values())
    [done] = [e for e in report.read_events()[0] if e["type"] == "cached"]
    assert done["entries"] == 4 and done["eval_entries"] == {"held": 4}


def test_the_plan_and_eval_sets_for_one_rank_of_a_larger_topology(cached):
    from pipetrain.backend.train.engine import plan_epochs
    from pipetrain.backend.train.eval import build_eval_sets

    cfg, adapter, data, report = cached
    silent = RunReporter(report, enabled=False)
    shares = []
    for rank in (0, 1):   # 4 ranks in 2 stages: data-parallel ranks 0 and 1 split each epoch
        topology = Topology(rank, 4, rank, pipeline_stages=2)
        plan = plan_epochs(cfg, data.entries, topology, silent)
        assert plan.steps_per_epoch() == 2                       # 4 images, batch 1 per rank, 2 ranks
        shares.append({e.latent for step in plan.epoch(1) for micro in step for e in micro})
        [held] = build_eval_sets(cfg, adapter, data, topology, silent)
        assert held.name == "held" and (held.feed.dp_rank, held.feed.dp_world) == (rank, 2)
    assert not shares[0] & shares[1] and shares[0] | shares[1] == {e.latent for e in data.entries}
