# SPDX-License-Identifier: GPL-3.0-or-later
"""Differential output preservation (``diff_output_preservation``, ai-toolkit's option): the adapted model, given a
training sample's caption with the trigger word swapped for its class (``diff_output_preservation_class``), should
predict what the base model predicts for that caption on the same noisy latent. That loss, times
``diff_output_preservation_multiplier``, is added to the training loss and logged on its own (``loss_dop``).

The pipeline carries the extra predictions along the batch dimension, so no stage needs a second schedule: each
training micro batch of ``b`` samples becomes ``3 b`` rows, ``[training | preservation | preservation]``, every third
with the same latent, noise and timestep, the last two with the preservation caption's embedding (cached like every
caption: its key is its text's, so another trigger word or class is another key). While the step runs
(``lora.base_rows(PARTS)``) the adapted layers leave the last third to the base weights, and the loss function on the
last stage takes it, detached, as the target of the middle third.
"""
from __future__ import annotations

import re

import torch

from .reg_loss import DOP_COUNT, DOP_LOSS, StepSums

PARTS = 3   # the rows of a micro batch: training, preservation (adapter on), preservation (adapter off: the target)


def preservation_caption(caption: str, trigger: str, cls: str) -> str:
    """``caption`` with each occurrence of ``trigger`` as a word of its own (not inside a longer word) replaced by
    ``cls``."""
    return re.sub(rf"(?<!\w){re.escape(trigger)}(?!\w)", lambda _: cls, caption)


def has_trigger(caption: str, trigger: str) -> bool:
    return preservation_caption(caption, trigger, "\0") != caption


class PreservationLoss:
    """The last stage's loss function: the training rows' loss by ``loss_fn`` (the adapter's, or ``SplitLoss``)
    plus ``multiplier`` times ``preservation_loss`` (``ModelAdapter.preservation_loss``) of the middle rows
    against the last, detached. A micro batch without preservation rows (an eval batch) gets ``loss_fn`` alone."""

    def __init__(self, loss_fn, preservation_loss, multiplier: float, tally: StepSums):
        self.loss_fn = loss_fn
        self.preservation_loss = preservation_loss
        self.multiplier = multiplier
        self.tally = tally

    def __call__(self, pred: torch.Tensor, labels):
        samples = labels[0].shape[0]
        if pred.shape[0] != PARTS * samples:
            return self.loss_fn(pred, labels)
        loss = self.loss_fn(pred[:samples], labels)
        kept = self.preservation_loss(pred[samples:2 * samples], pred[2 * samples:].detach())
        with torch.no_grad():
            self.tally.add({DOP_LOSS: kept.detach().float() * samples,
                            DOP_COUNT: torch.tensor(float(samples), device=kept.device)})
        return loss + self.multiplier * kept
