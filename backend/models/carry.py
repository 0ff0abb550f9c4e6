"""Passing tensors that take no gradient between pipeline stages.

DeepSpeed's pipeline engine expects every floating-point tensor crossing a stage boundary to receive a
gradient. Conditioning tensors computed from frozen weights (timestep vectors, rotary tables) do not, so
they travel bit-cast to an integer dtype of the same width and are viewed back where they are used. In a full
fine-tune the embedders train, their outputs require a gradient and travel as they are.
"""
import torch

_INT_OF = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def hide(t: torch.Tensor) -> torch.Tensor:
    """``t`` ready to cross a stage boundary: bit-cast when it takes no gradient; as it is when it does (a full
    fine-tune trains the embedders that make it, so its gradient must travel back)."""
    if t.requires_grad:
        return t
    return t.detach().contiguous().view(_INT_OF[t.dtype])


def reveal(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t.view(dtype)


def sizes(*values: int) -> torch.Tensor:
    """Integers that later layers read (a latent's grid, a count of tokens), carried on the host: reading a value
    back from the GPU makes the host wait until the GPU has run everything queued before it, once per read. At a
    stage boundary ``train.pipeline.sendable`` moves them to the device, since the engine sends device tensors."""
    return torch.tensor(values, dtype=torch.int64)


def with_grad(t: torch.Tensor) -> torch.Tensor:
    """A stage output must be part of a graph even when nothing upstream of it trains."""
    return t if t.requires_grad else t.detach().requires_grad_(True)


class _OwedZeroGradients(torch.autograd.Function):
    """Identity on ``out`` whose backward also hands exact zeros to ``unused``: a stage's float inputs that its
    head ignores (text context, a trained timestep vector) still owe the previous stage a gradient."""

    @staticmethod
    def forward(ctx, out, *unused):
        ctx.specs = [(u.shape, u.dtype, u.device) for u in unused]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return (grad, *(torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.specs))


class TupleLayer(torch.nn.Module):
    """A pipeline layer: DeepSpeed calls it with one tuple of tensors; subclasses implement ``run(*tensors)``.

    The head (the layer that returns one tensor, not a tuple) ties every float input that takes a gradient to its
    output, so a stage boundary right before it never leaves DeepSpeed a received tensor without a gradient."""

    def forward(self, inputs):
        out = self.run(*inputs)
        if not torch.is_tensor(out):
            return out
        owed = [x for x in inputs if torch.is_tensor(x) and x.is_floating_point() and x.requires_grad]
        return _OwedZeroGradients.apply(out, *owed) if owed and torch.is_grad_enabled() else out
