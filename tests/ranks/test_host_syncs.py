"""A training step queues its GPU work without waiting for the GPU: every value the host reads back (a latent's grid,
a noise schedule, SDXL's size conditioning) stays on the host or is made on the device once per bucket. One such
wait per step left the GPU idle while the host launched the next kernels (SDXL batch 8 on an H200: 60 ms a step
in ``DiscreteDiffusion``'s schedule copy)."""
import pytest
import torch
from layer_checks import checkpointed_layers, run_layers
from test_compile import _inputs, _sdxl_inputs, _small_flux, _small_sdxl

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def _step(adapter, layers, inputs):
    loss = adapter.loss(run_layers(layers, inputs), inputs[:3])
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("checkpointing", [False, True, "unsloth"])
@pytest.mark.parametrize("model", ["flux", "sdxl"])
def test_a_training_step_never_waits_for_the_gpu(model, checkpointing):
    """Checkpointed too: the recompute Function keeps the forward's RNG states, read from the host's copies."""
    adapter, inputs = (_small_flux(), _inputs(6, 10)) if model == "flux" else (_small_sdxl(), _sdxl_inputs(8, 8))
    adapter.diffusion_model.cuda()
    layers = checkpointed_layers(adapter, checkpointing)
    inputs = tuple(x.cuda() for x in inputs)
    _step(adapter, layers, inputs)          # the first step of a bucket may copy its tables to the device
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = _step(adapter, layers, inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss)
