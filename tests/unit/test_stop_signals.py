# SPDX-License-Identifier: GPL-3.0-or-later
"""One stop request arrives as several signals at once (the terminal's group, DeepSpeed's launch.py, the CLI
passing its own on): those are one request; a signal after them stops at once. The CLI's exit status follows the
run's status."""
import json
import signal

from pipetrain.backend.process.deepspeed_cli import outcome
from pipetrain.backend.train import stop_signals
from pipetrain.backend.train.stop_signals import StopSignals


def test_signals_together_are_one_request_and_a_later_one_stops_at_once(monkeypatch):
    at_once = []
    signals = StopSignals(at_once.append)
    assert not signals.requested
    signals.received(signal.SIGINT)
    signals.received(signal.SIGTERM)           # launch.py terminating its ranks after the same Ctrl-C
    signals.received(signal.SIGCHLD)           # not a stop
    assert signals.signum == signal.SIGINT and at_once == []
    late = StopSignals(at_once.append)
    late.received(signal.SIGTERM)              # launch.py's SIGTERM noted before the Ctrl-C it answers
    late.received(signal.SIGINT)
    assert late.signum == signal.SIGINT and at_once == []
    monkeypatch.setattr(stop_signals, "REPEAT_S", 0.0)   # the user's second, after the first's senders
    signals.received(signal.SIGTERM)
    assert at_once == [signal.SIGTERM]


def _status(tmp_path, **status):
    (tmp_path / "status.json").write_text(json.dumps(status))
    return str(tmp_path)


def test_cli_exit_status_says_whether_the_run_finished(tmp_path):
    assert outcome(_status(tmp_path, state="finished"), 0) == (0, None)
    assert outcome(_status(tmp_path, state="stopped", stop_signal=None), 1) == (0, None)   # the stop file
    code, why = outcome(_status(tmp_path, state="stopped", stop_signal=15, stop_reason="SIGTERM received: ..."), 1)
    assert code == 143 and "SIGTERM" in why
    code, why = outcome(_status(tmp_path, state="training"), 0)   # DeepSpeed's launcher killed: its runner says 0
    assert code == 1 and why.startswith(f"the run in {tmp_path} did not finish: its status is still 'training'")
    code, why = outcome(_status(tmp_path, state="failed", error="no space left in /x: free space\nmore"), 2)
    assert code == 2 and why == f"the run in {tmp_path} did not finish: no space left in /x: free space"
    assert outcome(None, 0)[0] == 1
