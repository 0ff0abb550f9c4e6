# SPDX-License-Identifier: GPL-3.0-or-later
"""``[monitoring] enable_wandb = true``: the run's scalars (the ones TensorBoard gets) also go to Weights & Biases,
from global rank 0, under one W&B run per PipeTrain run (its id, so a resume continues the same W&B run)."""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class WandbSink:
    def __init__(self, monitoring, run_id: str, run_dir, config: dict):
        import wandb

        if monitoring.wandb_api_key:
            wandb.login(key=monitoring.wandb_api_key)
        self._wandb = wandb
        self._run = wandb.init(project=monitoring.wandb_tracker_name or "pipetrain",
                               name=monitoring.wandb_run_name or run_id, id=run_id, resume="allow",
                               dir=str(run_dir), config=config)

    def log(self, step: int, values: dict) -> None:
        self._run.log(dict(values), step=step)

    def close(self) -> None:
        self._run.finish()


def attach(reporter, cfg, run_id: str, run_dir) -> None:
    """Give ``reporter`` (global rank 0's) a W&B sink when the config asks for one; the key never reaches the
    logged config."""
    m = cfg.monitoring
    if m is None or not m.enable_wandb or not reporter.enabled:
        return
    from ..config.schema import to_dict
    config = to_dict(cfg)   # secret fields left out
    reporter.wandb = WandbSink(m, run_id, run_dir, config)
    log.info("logging to Weights & Biases project %s", m.wandb_tracker_name or "pipetrain")
