"""``AdamW8bitKahan``: bitsandbytes' 8-bit AdamW with Kahan-compensated updates of 16-bit weights.

diffusion-pipe's class of the same name (``optimizers/adamw_8bit.py``) is a bitsandbytes subclass too; no
maintained library ships both halves (torchao's ``AdamW8bit`` rounds bf16 updates stochastically instead,
torch-optimi's and pytorch_optimizer's ``kahan_sum`` keep 32-bit states). Here bitsandbytes' own update (its
8-bit block-wise kernels, which also run on the CPU) steps a float32 working copy ``w = p + shift`` of each
bfloat16/float16 weight, one tensor at a time; the result is rounded into ``p`` and what rounding lost is
kept in ``shift`` (same dtype as ``p``), so updates far below the weight's precision still add up. Float32
weights take bitsandbytes' path unchanged. Memory per weight: the 16-bit weight, a 16-bit shift and two
8-bit states.
"""
from __future__ import annotations

import torch
from bitsandbytes.optim import AdamW8bit

COMPENSATED = (torch.bfloat16, torch.float16)


class AdamW8bitKahan(AdamW8bit):
    @torch.no_grad()
    def init_state(self, group, p, gindex, pindex):
        super().init_state(group, p, gindex, pindex)
        if p.dtype in COMPENSATED:
            self.state[p]["shift"] = torch.zeros_like(p)

    @torch.no_grad()
    def update_step(self, group, p, gindex, pindex):
        shift = self.state[p].get("shift")
        if shift is None:
            return super().update_step(group, p, gindex, pindex)
        weight, grad = p.data, p.grad
        work = weight.float().add_(shift.float())     # the weight as Kahan summation knows it
        p.data, p.grad = work, grad.float()
        try:
            super().update_step(group, p, gindex, pindex)
        finally:
            p.data, p.grad = weight, grad
        weight.copy_(work)                            # rounded to the weight's dtype
        shift.copy_(work.sub_(weight.float()))        # what the rounding lost, added back next step
