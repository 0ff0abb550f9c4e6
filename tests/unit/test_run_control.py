# SPDX-License-Identifier: GPL-3.0-or-later
"""Run control without a run: the request files (written, claimed once, unreadable ones dropped), the learning
rate's bounds, and a new base learning rate in the schedule (the next step uses it, a state dict keeps it)."""
import json
import math

import pytest
import torch

from pipetrain.backend.run import control as run_control
from pipetrain.backend.run.control import ControlValueError, Requests
from pipetrain.backend.run.folder import RunDir
from pipetrain.backend.train.schedule import lr_multiplier, set_base_lr


@pytest.mark.parametrize("value", [0, -1e-4, 0.0, "nan", float("nan"), float("inf"), "-inf", "1e999", 10 ** 400,
                                   run_control.MAX_LR * 1.01, True, None, "abc", [1e-4], {"lr": 1}, ""])
def test_a_learning_rate_that_is_no_learning_rate_is_refused(value):
    with pytest.raises(ControlValueError, match="learning rate"):
        run_control.check_lr(value)


def test_learning_rates_in_range_are_taken_as_floats():
    assert run_control.check_lr(1e-4) == 1e-4 and run_control.check_lr("2e-5") == 2e-5
    assert run_control.check_lr(1) == 1.0 and run_control.check_lr(run_control.MAX_LR) == run_control.MAX_LR


def test_requests_are_claimed_once_and_the_newest_lr_wins(tmp_path):
    run = RunDir(tmp_path)
    assert run_control.take(run) == (Requests(), [])          # no control folder: nothing asked
    run_control.request(run, "save")
    run_control.request(run, "lr", 1e-4)
    run_control.request(run, "lr", "3e-5")
    assert run_control.take(run) == (Requests(save=True, lr=3e-5), [])
    assert run_control.take(run) == (Requests(), [])          # taken: not acted on twice
    assert sorted(p.name for p in run.control.iterdir()) == []
    for action in ("sample", "stop_after_epoch"):
        run_control.request(run, action)
    assert run_control.take(run)[0] == Requests(sample=True, stop_after_epoch=True)
    with pytest.raises(ControlValueError, match="unknown run control"):
        run_control.request(run, "delete_everything")


def test_an_unreadable_lr_request_is_dropped_with_a_reason(tmp_path):
    run = RunDir(tmp_path)
    run.control.mkdir()
    (run.control / "lr.json").write_text('{"lr": NaN}')
    (run.control / "save.json").write_text("not json")          # an action needs no body
    requests, problems = run_control.take(run)
    assert requests == Requests(save=True) and len(problems) == 1 and "lr.json ignored" in problems[0]


def test_clear_forgets_requests_never_taken(tmp_path):
    run = RunDir(tmp_path)
    run_control.request(run, "stop_after_epoch")
    run_control.clear(run)
    assert run_control.take(run) == (Requests(), [])


def _schedule(lr=1e-3, kind="cosine", warmup=2, total=10):
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
    opt = torch.optim.SGD([{"params": params[:1], "lr": lr}, {"params": params[1:], "lr": lr * 2}], lr=lr)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_multiplier(kind, warmup, total))


def test_a_new_base_lr_applies_from_the_next_step_with_the_schedule_on_top():
    opt, sched = _schedule()
    for _ in range(4):
        opt.step()
        sched.step()
    f = lr_multiplier("cosine", 2, 10)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * f(4))
    set_base_lr(sched, 5e-4)
    # the next step trains at the new base times the schedule's multiplier; the second group keeps its ratio
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([5e-4 * f(4), 1e-3 * f(4)])
    opt.step()
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([5e-4 * f(5), 1e-3 * f(5)])
    # a checkpoint's scheduler state carries it into a resumed run's fresh scheduler
    opt2, sched2 = _schedule()
    sched2.load_state_dict(sched.state_dict())
    opt2.load_state_dict(opt.state_dict())
    opt2.step()
    sched2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(5e-4 * f(6)) and not math.isclose(f(6), 1.0)


def test_a_constant_schedule_logs_exactly_the_lr_asked_for():
    opt, sched = _schedule(kind="constant", warmup=0)
    opt.step()
    sched.step()
    set_base_lr(sched, 2.5e-5)
    assert opt.param_groups[0]["lr"] == 2.5e-5 and sched.get_last_lr()[0] == 2.5e-5


def test_an_applied_lr_is_kept_for_a_resume_and_a_bad_record_is_refused_naming_it(tmp_path):
    run = RunDir(tmp_path)
    assert run_control.applied_lr(run) is None
    run_control.record_lr(run, 7.5e-4, 12)
    assert run_control.applied_lr(run) == (7.5e-4, 12)
    for body in ({"lr": 1e4, "from_step": 3}, {"lr": 1e-4, "from_step": "3"}, ["x"]):
        run.controls_file.write_text(json.dumps(body))
        with pytest.raises(run_control.ControlValueError, match=str(run.controls_file)):
            run_control.applied_lr(run)
    recorded = json.dumps({"lr": 7.5e-4, "from_step": 12}).encode()
    for damaged in (recorded[:len(recorded) // 2], b"\xff\x00" + recorded):   # cut, or bytes that are no text
        run.controls_file.write_bytes(damaged)
        with pytest.raises(run_control.ControlValueError, match=f"{run.controls_file}: not a learning rate change"):
            run_control.applied_lr(run)
