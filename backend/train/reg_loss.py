# SPDX-License-Identifier: GPL-3.0-or-later
"""The loss of the regularisation samples (``is_reg`` directories) apart from the training samples'.

The feed puts a boolean mask (which samples are regularisation ones) after a training micro batch's labels
(``MicroBatchFeed(reg_labels=True)``); ``SplitLoss`` is the pipeline's loss function on the last stage: it
returns the adapter's loss of the micro batch unchanged (what trains), and adds each sample's loss, computed
by the same loss function, to the step's sums per kind. After the step every rank adds its sums into one
all-reduce (the stages before the last have none), which global rank 0 reports: ``train/loss_reg`` and
``train/loss_main`` (the training samples'), the means over the step's samples of each kind. Differential output
preservation (``preservation.py``) adds its loss to the same sums (``StepSums``), reported as ``train/loss_dop``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# the step's sums: regularisation loss, regularisation samples, training loss, training samples, and differential
# output preservation's loss (each micro batch's times its samples) and samples (train/preservation.py)
REG_LOSS, REG_COUNT, MAIN_LOSS, MAIN_COUNT, DOP_LOSS, DOP_COUNT = range(6)


class StepSums:
    """One step's loss sums on this rank, added to by the loss functions on the last stage."""

    def __init__(self):
        self.sums: torch.Tensor | None = None

    def add(self, values: dict[int, torch.Tensor]) -> None:
        device = next(iter(values.values())).device
        sums = torch.zeros(DOP_COUNT + 1, device=device)
        for slot, value in values.items():
            sums[slot] = value
        self.sums = sums if self.sums is None else self.sums + sums

    def step_sums(self, world: int, device: torch.device) -> torch.Tensor:
        """The step's sums over every rank (every rank calls it once a step; zeros where a rank has none), and a
        fresh start for the next step. No host sync: the all-reduce queues behind the step."""
        sums = self.sums if self.sums is not None else torch.zeros(DOP_COUNT + 1, device=device)
        self.sums = None
        if world > 1:
            dist.all_reduce(sums)
        return sums


class SplitLoss:
    def __init__(self, loss_fn, tally: StepSums | None = None):
        self.loss_fn = loss_fn
        self.tally = tally or StepSums()   # this step's, on the last stage

    def __call__(self, pred, labels):
        if not (labels and labels[-1].dtype == torch.bool):   # no mask: an eval batch
            return self.loss_fn(pred, labels)
        *labels, reg = labels
        labels = tuple(labels)
        loss = self.loss_fn(pred, labels)
        with torch.no_grad():
            self._add(self._per_sample(loss, pred, labels), reg)
        return loss

    def _per_sample(self, loss, pred, labels) -> torch.Tensor:
        """Each sample's loss; with one sample the micro batch's (a sample's loss is the mean over its elements, and
        a micro batch holds one bucket: the batch loss is the mean of its samples' losses)."""
        if pred.shape[0] == 1:
            return loss.detach().float().reshape(1)
        return torch.stack([self.loss_fn(pred[i:i + 1], tuple(x[i:i + 1] for x in labels)).float()
                            for i in range(pred.shape[0])])

    def _add(self, per_sample: torch.Tensor, reg: torch.Tensor) -> None:
        r = reg.to(per_sample.device, torch.float32)
        self.tally.add({REG_LOSS: (per_sample * r).sum(), REG_COUNT: r.sum(), MAIN_LOSS: (per_sample * (1 - r)).sum(),
                        MAIN_COUNT: (1 - r).sum()})

    @property
    def sums(self) -> torch.Tensor | None:
        return self.tally.sums

    def step_sums(self, world: int, device: torch.device) -> torch.Tensor:
        return self.tally.step_sums(world, device)


def group_losses(sums: torch.Tensor | None) -> dict[str, float]:
    """``loss_reg`` / ``loss_main`` of a step from its sums (a kind the step had no sample of is left out), and
    ``reg_samples``, how many of the step's samples were regularisation ones (where the split was kept); with
    differential output preservation ``loss_dop``, its loss before the multiplier."""
    if sums is None:
        return {}
    values = [float(v) for v in sums.tolist()] + [0.0] * (DOP_COUNT + 1 - len(sums))
    out = {}
    if values[REG_COUNT] or values[MAIN_COUNT]:
        out["reg_samples"] = int(round(values[REG_COUNT]))
    if values[REG_COUNT]:
        out["loss_reg"] = values[REG_LOSS] / values[REG_COUNT]
    if values[MAIN_COUNT]:
        out["loss_main"] = values[MAIN_LOSS] / values[MAIN_COUNT]
    if values[DOP_COUNT]:
        out["loss_dop"] = values[DOP_LOSS] / values[DOP_COUNT]
    return out
