"""Training learns: on a fixed 2-image dataset the mean loss of the last 8 of 40 steps is at least 15%
below the mean of the first 8 (measured: 1.196 -> 0.913, -24%; the runs are seeded and repeatable). And the
run's loss is the configured ``loss_type``."""
import statistics

import pytest
from conftest import train

pytestmark = pytest.mark.slow


def test_loss_falls_on_fixed_tiny_dataset(micro_flux_files, make_run):
    config = make_run(micro_flux_files, images=2, stages=1, epochs=20, checkpoint_every_n_epochs=None,
                      save_every_n_epochs=20, adapter={"rank": 8, "alpha": 8.0},
                      optimizer={"type": "adamw", "lr": 3e-3})
    dataset = config.with_name("dataset.toml")
    dataset.write_text(dataset.read_text().replace("enable_ar_bucket = true", "enable_ar_bucket = false"))
    run = train(config, ranks=1)
    assert run.returncode == 0, run.output[-3000:]
    losses = run.losses()
    assert len(losses) == 40
    first, last = statistics.mean(losses[:8]), statistics.mean(losses[-8:])
    assert last < 0.85 * first, (first, last)


def test_the_configured_loss_type_is_the_loss_a_run_trains_with(micro_flux_files, make_run):
    """The first step's loss comes from the untrained weights (the LoRA starts at zero) and the same seeded batch
    in both runs: Huber with a delta far above every error is exactly half the squared error, so the run's loss
    is the configured one (an ignored loss_type would report the MSE itself)."""
    losses = {}
    for name, keys in (("mse", {}), ("huber", {"loss_type": "huber", "huber_delta": 1e6})):
        config = make_run(micro_flux_files, images=2, name=name, stages=1, epochs=1, max_steps=1,
                          checkpoint_every_n_epochs=None, **keys)
        run = train(config, ranks=1)
        assert run.returncode == 0, run.output[-3000:]
        losses[name] = run.losses()
    assert len(losses["mse"]) == len(losses["huber"]) == 1
    assert losses["huber"][0] == pytest.approx(0.5 * losses["mse"][0], rel=1e-5), losses
