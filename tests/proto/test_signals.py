"""A service's main loop takes its signals without locks (proto/signals.py): a storm of them,
landing wherever the loop happens to be, is neither lost nor able to hang it."""

from __future__ import annotations

import os
import signal
import threading
import time

from kvguard.proto.signals import Signals


def test_a_storm_of_signals_neither_hangs_the_loop_nor_is_lost() -> None:
    signals = Signals(signal.SIGHUP)
    sent = 3000
    done = threading.Event()

    def storm() -> None:
        for _ in range(sent):
            os.kill(os.getpid(), signal.SIGHUP)
        os.kill(os.getpid(), signal.SIGUSR1)  # the last one: ends the loop
        done.set()

    try:
        signals.listen(signal.SIGUSR1)
        threading.Thread(target=storm, daemon=True).start()
        rounds, seen = 0, set()
        deadline = time.monotonic() + 60
        while signal.SIGUSR1 not in seen:
            assert time.monotonic() < deadline, f"the loop took {rounds} rounds, then nothing more"
            seen |= signals.wait(0.05)
            rounds += 1
        assert seen == {signal.SIGHUP, signal.SIGUSR1} and done.wait(10)
        assert signals.wait(0) == set()  # each taken once
    finally:
        signals.close()
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)


def test_a_signal_before_the_wait_is_kept_for_it() -> None:
    signals = Signals(signal.SIGHUP)
    try:
        os.kill(os.getpid(), signal.SIGHUP)  # while nothing waits: kept for the next wait
        assert signals.wait(30) == {signal.SIGHUP}
    finally:
        signals.close()
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
