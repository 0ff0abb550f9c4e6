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


def with_grad(t: torch.Tensor) -> torch.Tensor:
    """A stage output must be part of a graph even when nothing upstream of it trains."""
    return t if t.requires_grad else t.detach().requires_grad_(True)


class TupleLayer(torch.nn.Module):
    """A pipeline layer: DeepSpeed calls it with one tuple of tensors; subclasses implement ``run(*tensors)``."""

    def forward(self, inputs):
        return self.run(*inputs)
