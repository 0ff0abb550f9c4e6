"""``blocks_to_swap = N``: the frozen weights of N transformer blocks per pipeline stage live in CPU memory and
are copied to the accelerator just before they are used, then dropped again (diffusion-pipe's block swapping).

Generic over every architecture: a pipeline layer is swappable when it holds its ComfyUI block as
``layer.swappable`` (or ``layer.block``); the last N such layers of a stage swap, as diffusion-pipe swaps the
last N blocks. Only frozen parameters move (adapters stay, the optimizer needs them in place); each one's
home copy sits in pinned CPU memory, and between uses the parameter holds an empty placeholder.

When a weight is needed:
- forward: a pre-hook on the layer brings the block in (waiting for the prefetch started when the previous
  swapped block ran), starts prefetching the next swapped block, and a post-hook drops the block again;
- backward: a hook on the layer's outputs brings the block back before its backward (and before any
  activation-checkpoint recompute) runs, prefetching the block before it; a hook on the layer's inputs
  drops it once its backward is done. Autograd's saved references to a weight are the parameter itself, so
  they see the weight again once it is back.
Copies to a GPU are ``non_blocking`` on a side CUDA stream, ordered with events; on the CPU the same code path
copies between CPU tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


def swappable_module(layer: nn.Module) -> nn.Module | None:
    return getattr(layer, "swappable", None) or getattr(layer, "block", None)


@dataclass
class SwapStats:
    fetches: int = 0          # a block brought to the device (sync or prefetched)
    prefetches: int = 0       # of which started ahead of use
    releases: int = 0         # a block dropped from the device
    bytes_in: int = 0
    events: list = field(default_factory=list)   # (kind, slot) in order, kept when ``record`` is set


class _Slot:
    """One swapped block: its frozen parameters, their home copies and the device copies while resident."""

    def __init__(self, module: nn.Module, device: torch.device, pin: bool):
        self.params = [p for p in module.parameters() if not p.requires_grad]
        self.home = []
        for p in self.params:
            home = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin)
            home.copy_(p.data)
            self.home.append(home)
        self.placeholders = [torch.empty(0, dtype=p.dtype, device=device) for p in self.params]
        self.resident = False
        self.pending = None       # (device tensors, event) of a prefetch in flight
        self.drop()

    def drop(self) -> None:
        for p, empty in zip(self.params, self.placeholders):
            p.data = empty
        self.resident = False

    def nbytes(self) -> int:
        return sum(h.numel() * h.element_size() for h in self.home)


class BlockSwapper:
    def __init__(self, modules: list[nn.Module], device: torch.device, record: bool = False):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self.slots = [_Slot(m, self.device, self.cuda) for m in modules]
        self.stats = SwapStats()
        self.record = record

    # --- moving weights ------------------------------------------------------------------------
    def _copies(self, slot: _Slot) -> list[torch.Tensor]:
        return [torch.empty(h.shape, dtype=h.dtype, device=self.device).copy_(h, non_blocking=True)
                for h in slot.home]

    def prefetch(self, i: int) -> None:
        slot = self.slots[i]
        if slot.resident or slot.pending is not None:
            return
        for other in self.slots:      # one prefetch in flight at a time bounds the extra memory
            other.pending = None
        if self.cuda:
            with torch.cuda.stream(self.stream):
                tensors = self._copies(slot)
                event = torch.cuda.Event()
                event.record(self.stream)
        else:
            tensors, event = self._copies(slot), None
        slot.pending = (tensors, event)
        self.stats.prefetches += 1
        self._log("prefetch", i)

    def fetch(self, i: int) -> None:
        """Make block ``i``'s weights resident on the device (a no-op when they are)."""
        slot = self.slots[i]
        if slot.resident:
            return
        if slot.pending is not None:
            tensors, event = slot.pending
            slot.pending = None
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)
                for t in tensors:      # allocated on the side stream, used on the compute stream
                    t.record_stream(torch.cuda.current_stream(self.device))
        else:
            tensors = self._copies(slot)
        for p, t in zip(slot.params, tensors):
            p.data = t
        slot.resident = True
        self.stats.fetches += 1
        self.stats.bytes_in += slot.nbytes()
        self._log("fetch", i)

    def release(self, i: int) -> None:
        slot = self.slots[i]
        if slot.resident:
            slot.drop()
            self.stats.releases += 1
            self._log("release", i)

    def _log(self, kind: str, i: int) -> None:
        if self.record:
            self.stats.events.append((kind, i))

    # --- hooks on the pipeline layers --------------------------------------------------------------
    def attach(self, layers: list[nn.Module]) -> None:
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(self._pre_forward(i))
            layer.register_forward_hook(self._post_forward(i))

    def _pre_forward(self, i: int):
        def hook(module, args):
            self.fetch(i)
            if i + 1 < len(self.slots):
                self.prefetch(i + 1)
            if not torch.is_grad_enabled() or not args:
                return None
            x = args[0]
            items = list(x) if isinstance(x, tuple) else [x]
            grad_at = [k for k, t in enumerate(items) if torch.is_tensor(t) and t.requires_grad]
            if not grad_at:
                return None
            fenced = _ReleaseAfterBackward.apply(self, i, *[items[k] for k in grad_at])
            for k, t in zip(grad_at, fenced if isinstance(fenced, tuple) else (fenced,)):
                items[k] = t
            return (tuple(items) if isinstance(x, tuple) else items[0], *args[1:])
        return hook

    def _post_forward(self, i: int):
        def hook(module, args, output):
            inputs = {id(t) for t in _tensors(args)}
            outs = [t for t in _tensors(output) if t.requires_grad and id(t) not in inputs]
            if torch.is_grad_enabled() and outs:
                fired = []

                def before_backward(grad):
                    if not fired:
                        fired.append(True)
                        self.fetch(i)
                        if i > 0:
                            self.prefetch(i - 1)
                    return grad
                for t in outs:
                    t.register_hook(before_backward)
            self.release(i)
            return None
        return hook


def _tensors(value) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


class _ReleaseAfterBackward(torch.autograd.Function):
    """Identity on a layer's inputs that take a gradient; its backward runs once the layer's backward is done."""

    @staticmethod
    def forward(ctx, swapper, i, *tensors):
        ctx.swapper, ctx.i = swapper, i
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.swapper.release(ctx.i)
        return (None, None, *grads)


def enable_block_swap(module, n: int, device, file=None) -> BlockSwapper | None:
    """Swap the last ``n`` swappable layers of this rank's pipeline stage (``module``: the ``PipelineModule``)."""
    from ..errors import ConfigError

    if not n:
        return None
    layers = [f for f in module.forward_funcs if isinstance(f, nn.Module) and swappable_module(f) is not None]
    if n >= len(layers):
        raise ConfigError(f"got {n}, but pipeline stage {module.stage_id} holds {len(layers)} transformer blocks; "
                          f"swap fewer than the blocks of a stage (at most {max(len(layers) - 1, 0)} here), or use "
                          "fewer pipeline_stages", file=file, key="blocks_to_swap")
    chosen = layers[len(layers) - n:]
    swapper = BlockSwapper([swappable_module(layer) for layer in chosen], device)
    swapper.attach(chosen)
    return swapper
