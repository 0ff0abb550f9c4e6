"""Steps reported one late (no host sync after each step) and gradient clipping with foreach kernels: the
deferral reports every step once, in order, before the events that follow it; the clipping matches
DeepSpeed's clip_grad_norm_, norm and clipped gradients."""
from types import SimpleNamespace

import pytest
import torch
from conftest import train

from pipetrain.backend.train import clipping
from pipetrain.backend.train.reporting import PendingStep, StepReports, pending_step

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_steps_are_reported_one_late_and_flush_reports_the_last():
    reported = []
    reports = StepReports(reported.append, started=9.0)
    # issued_at: on CPU (no event) a step's end, as train_batch returns with its work done
    reports.issued(PendingStep(1, 0, 0.1, torch.tensor(1.5), torch.tensor(4.0), prodigy_d=2.0, issued_at=10.0))
    assert reported == []
    reports.issued(PendingStep(2, 0, 0.2, torch.tensor(2.5), issued_at=13.0))
    assert [s.step for s in reported] == [1]
    first = reported[0]
    assert (first.loss, first.lr, first.grad_norm, first.prodigy_d) == (1.5, 0.1, 4.0, 2.0)
    assert isinstance(first.loss, float) and isinstance(first.grad_norm, float)
    reports.flush()
    assert [s.step for s in reported] == [1, 2] and reported[1].grad_norm is None
    reports.flush()                             # nothing pending: nothing reported twice
    reports.issued(PendingStep(3, 1, 0.3, 3.5, issued_at=14.5))
    reports.flush()
    assert [s.step for s in reported] == [1, 2, 3]
    assert [s.step_time for s in reported] == [1.0, 3.0, 1.5]
    assert [s.steps_done for s in reported] == [1, 2, 3]


class _ClockEvent:
    """A stand-in for a timing CUDA event that the device reached at ``at`` seconds on its clock."""

    def __init__(self, at: float):
        self.at = at

    def synchronize(self):
        pass

    def elapsed_time(self, end: "_ClockEvent") -> float:
        return (end.at - self.at) * 1000


def test_with_events_a_step_time_is_read_on_the_device_clock_not_when_the_host_got_to_it():
    """The host reports step 1 only after queueing step 2 (here: after step 1 had long ended); its time is the
    device's, from the loop's start event to its own, and step 2's from step 1's event to its own."""
    reported = []
    reports = StepReports(reported.append, started=0.0, start=_ClockEvent(100.0))
    reports.issued(PendingStep(1, 0, 0.1, 1.0, done=_ClockEvent(100.4)))
    reports.issued(PendingStep(2, 0, 0.1, 1.0, done=_ClockEvent(100.9)))
    reports.flush()
    assert [round(s.step_time, 6) for s in reported] == [0.4, 0.5]


def _device_work(x: torch.Tensor, products: int) -> torch.Tensor:
    y = x
    for _ in range(products):
        y = y @ x
    return y.sum()


@pytest.mark.gpu
@CUDA
def test_issuing_a_cuda_step_does_not_wait_for_it():
    x = torch.randn(4096, 4096, device="cuda") / 64
    reported = []
    reports = StepReports(reported.append, started=0.0)
    reports.issued(pending_step(1, 0, 0.1, _device_work(x, 2), torch.ones((), device="cuda"), None))
    second_loss = _device_work(x, 200)          # about a second on the device
    second = pending_step(2, 0, 0.1, second_loss, None, None)
    reports.issued(second)
    assert [(s.step, s.grad_norm) for s in reported] == [(1, 1.0)]
    assert not second.done.query()              # step 2 still running: reporting step 1 waited for step 1 alone
    reports.flush()
    assert second.done.query() and [s.step for s in reported] == [1, 2]
    assert reported[1].loss == second_loss.item()


@pytest.fixture
def one_rank_comm(monkeypatch):
    """deepspeed.comm as a single rank (all-reduce is the identity) for DeepSpeed's clip_grad_norm_ and ours,
    without a process group in the test process."""
    from deepspeed.runtime import utils as ds_utils
    from deepspeed.utils import groups

    comm = SimpleNamespace(ReduceOp=SimpleNamespace(SUM="sum", MAX="max"),
                           all_reduce=lambda tensor, op=None, group=None: None,
                           get_world_size=lambda group=None: 1)
    monkeypatch.setattr(ds_utils, "dist", comm)
    monkeypatch.setattr(clipping, "dist", comm)
    monkeypatch.setattr(groups, "_get_data_parallel_group", lambda: None)
    return ds_utils.clip_grad_norm_


def _params(seed: int = 0, device: str = "cpu") -> list[torch.nn.Parameter]:
    """Float32 and bfloat16 parameters of several shapes, one without a gradient."""
    g = torch.Generator().manual_seed(seed)
    shapes = [((4, 8), torch.float32), ((8,), torch.float32), ((3, 5, 2), torch.bfloat16), ((16, 4), torch.float32),
              ((7,), torch.bfloat16)]
    params = []
    for shape, dtype in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=g).to(device, dtype))
        p.grad = torch.randn(shape, generator=g).to(device, dtype)
        params.append(p)
    params.append(torch.nn.Parameter(torch.randn(3, generator=g)))
    return params


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])])
@pytest.mark.parametrize("max_norm", [0.5, 1e3])      # clipped; left alone (coefficient 1)
def test_clip_grad_norm_matches_deepspeed(one_rank_comm, max_norm, device):
    ours, theirs = _params(device=device), _params(device=device)
    norm = clipping.clip_grad_norm_(ours, max_norm)
    expected = one_rank_comm(theirs, max_norm)
    assert norm.shape == () and norm.dtype == torch.float32
    assert norm.item() == pytest.approx(expected.item(), rel=1e-6)
    for a, b in zip(ours, theirs):
        if b.grad is None:
            assert a.grad is None
            continue
        assert a.grad.dtype == b.grad.dtype
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)


def test_clip_grad_norm_with_mpu_counts_only_model_parallel_parameters_off_rank_0(one_rank_comm):
    mpu = SimpleNamespace(get_model_parallel_rank=lambda: 1, get_model_parallel_group=lambda: None)
    ours, theirs = _params(1), _params(1)
    for params in (ours, theirs):
        params[0].model_parallel = True
        params[3].tensor_model_parallel = True
    counted = torch.cat([ours[0].grad.flatten(), ours[3].grad.flatten()]).norm().item()
    norm = clipping.clip_grad_norm_(ours, 0.1, mpu=mpu)
    expected = one_rank_comm(theirs, 0.1, mpu=mpu)
    assert norm.item() == pytest.approx(expected.item(), rel=1e-6)
    assert norm.item() == pytest.approx(counted, rel=1e-6)
    for a, b in zip(ours, theirs):
        if b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)


@pytest.mark.slow
def test_training_reports_every_step_once_in_order(micro_flux_files, make_run):
    """One rank, two epochs, a step LoRA every 3 steps, clipping, a checkpoint each epoch: each step's event
    comes before everything reported after that step, none lost or repeated."""
    config = make_run(micro_flux_files, images=4, name="order", stages=1, epochs=2, save_every_n_steps=3,
                      gradient_clipping=1.0)
    run = train(config, ranks=1)
    assert run.returncode == 0, run.output[-4000:]
    total = run.events("engine")[0]["total_steps"]
    steps = run.events("step")
    assert [e["step"] for e in steps] == list(range(1, total + 1))
    assert all(torch.isfinite(torch.tensor([e["loss"], e["grad_norm"]])).all() for e in steps)
    reported = 0
    for e in run.events():
        if e["type"] == "step":
            reported = e["step"]
        elif e["type"] in ("epoch", "step_lora_saved", "lora_saved", "checkpoint", "done"):
            assert e["step"] == reported, e    # its step was reported, the next one not yet
    assert [e["step"] for e in run.events("step_lora_saved")] == list(range(3, total + 1, 3))
    assert len(run.events("epoch")) == 2 and run.events("done")[0]["step"] == total
    assert run.status()["step"] == total
