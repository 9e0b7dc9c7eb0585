"""Ctrl-C during a sweep: Kiln records it and hands Tune its graceful stop (SIGUSR1)."""

import os
import signal

import pytest

from kiln.sweep.run import _InterruptBridge


def test_first_ctrl_c_is_recorded_and_forwarded_second_aborts():
    forwarded = []
    before_int = signal.getsignal(signal.SIGINT)
    before_usr1 = signal.signal(signal.SIGUSR1, lambda *_: forwarded.append("usr1"))  # stands in for Tune's
    try:
        with _InterruptBridge() as bridge:
            assert os.environ["TUNE_DISABLE_SIGINT_HANDLER"] == "1"  # Tune must not take SIGINT over
            signal.raise_signal(signal.SIGINT)
            assert bridge.seen and forwarded == ["usr1"]
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is before_int
        assert "TUNE_DISABLE_SIGINT_HANDLER" not in os.environ
    finally:
        signal.signal(signal.SIGUSR1, before_usr1)


def test_no_interrupt_means_not_seen():
    with _InterruptBridge() as bridge:
        pass
    assert not bridge.seen


def test_ctrl_c_before_tune_listens_is_a_plain_keyboard_interrupt():
    before_usr1 = signal.signal(signal.SIGUSR1, signal.SIG_DFL)  # SIG_DFL would kill the process
    try:
        with pytest.raises(KeyboardInterrupt), _InterruptBridge():
            signal.raise_signal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGUSR1, before_usr1)
