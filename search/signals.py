"""How a search process stops: a Ctrl-C flag that raises only inside a trial's replay, and a worker's watch on its parent (kill -9 included).

Apart from the study runner (search/study.py) so that the batch runner's worker processes
(search/pool.py) share them without importing the runner.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time


class Flag:
    """A flag a signal handler may set: no lock, unlike threading.Event.

    A handler runs between two bytecodes of the main thread, and a second signal can run a second
    handler inside the first; ``threading.Event.set`` takes a lock, so a nested set waits on the lock
    its outer self holds, forever (a worker hung that way when the kernel and its parent-watch thread
    signalled it at once). Setting an attribute is one store.
    """

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


class Interrupt:
    """Ctrl-C (SIGINT), or SIGTERM in a local worker, as a flag: the study stops between trials.

    A signal only raises KeyboardInterrupt while the objective itself runs (so a long replay stops
    at once and its trial is failed as ``interrupted``); anywhere else — Optuna's ask and tell,
    storage writes, callbacks — it only sets the flag, and the study stops after that trial's
    bookkeeping. Raising there used to break Optuna's tell (``UnboundLocalError: updated_state``).
    """

    def __init__(self) -> None:
        self.event = Flag()
        self.evaluator = None  # an Evaluator once the study loop runs; its in_trial tells where we are
        self._previous: dict[int, object] = {}

    def is_set(self) -> bool:
        return self.event.is_set()

    def handler(self, signum, frame) -> None:
        first = not self.event.is_set()
        self.event.set()
        evaluator = self.evaluator
        if first and evaluator is not None and evaluator.in_trial:
            raise KeyboardInterrupt

    def install(self, signals=(signal.SIGINT,)) -> "Interrupt":
        if threading.current_thread() is threading.main_thread():
            for sig in signals:
                self._previous.setdefault(sig, signal.signal(sig, self.handler))
        return self

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()


PARENT_POLL_S = 0.5
_PR_SET_PDEATHSIG = 1
# The signal that says "the parent died", apart from SIGTERM (the parent stopping its workers on
# Ctrl-C, when it writes trials.parquet itself): the worker must know which one it got, because
# getppid() cannot tell yet. PR_SET_PDEATHSIG fires when the parent *thread* that started the worker
# exits; under kill -9 the parent's threads die one by one, and the worker is first handed to another
# thread of the dying parent (same pid) with the signal already sent, then to init with a second one.
PARENT_DIED = getattr(signal, "SIGUSR1", signal.SIGTERM)


class _ParentWatch:
    """Stop this worker when the `search` process that started it dies, even by kill -9.

    Linux: the kernel sends PARENT_DIED when the parent exits (prctl PR_SET_PDEATHSIG). Everywhere, a
    thread also checks every PARENT_POLL_S that the parent is still ours (an orphan is re-parented)
    and sends PARENT_DIED itself. The signal is handled like Ctrl-C (the trial in flight is failed as
    interrupted) and remembered: the worker then writes trials.parquet, which the dead parent cannot.
    """

    def __init__(self, parent_pid: int, interrupt: "Interrupt") -> None:
        self.parent_pid = parent_pid
        self.died = Flag()
        self._interrupt = interrupt
        if threading.current_thread() is threading.main_thread():
            signal.signal(PARENT_DIED, self._handler)
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                libc = ctypes.CDLL(None, use_errno=True)
                libc.prctl(_PR_SET_PDEATHSIG, PARENT_DIED, 0, 0, 0)
            except (OSError, AttributeError):
                pass
        if self.gone():  # it died before the prctl above took effect
            os.kill(os.getpid(), PARENT_DIED)
        threading.Thread(target=self._watch, name="servelab-parent-watch", daemon=True).start()

    def gone(self) -> bool:
        return self.died.is_set() or os.getppid() != self.parent_pid

    def _handler(self, signum, frame) -> None:
        self.died.set()
        self._interrupt.handler(signum, frame)

    def _watch(self) -> None:
        while os.getppid() == self.parent_pid:
            time.sleep(PARENT_POLL_S)
        os.kill(os.getpid(), PARENT_DIED)

    def close(self) -> None:
        """The worker is about to exit: a late PARENT_DIED (the kernel's second, the watcher's) is ignored."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(PARENT_DIED, signal.SIG_IGN)


__all__ = ["Flag", "Interrupt", "PARENT_DIED", "PARENT_POLL_S"]
