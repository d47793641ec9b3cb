"""Rewards scored in worker processes under a deadline that cannot be caught.

A signal-based timeout (SIGALRM) runs inside the reward function, and math-verify catches every exception its
parser raises, timeouts included: a response such as `$\\boxed{9^{9^{9^{9}}}}$` then keeps scoring for minutes.
Here each sample is sent to a spawned process; the trainer waits on the pipes and SIGKILLs a process whose sample
runs past `timeout_s` (that sample scores 0 and counts as an error), then starts a fresh process in its place. A
process that dies while scoring (killed for memory, a crash in a C extension) costs its sample the same way; the
sample is never scored again, in a worker or in the trainer. A score is a function of the text alone: which
process scores which sample changes no bit.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import signal
import threading
import time
from collections import deque
from multiprocessing.connection import wait

STARTUP_TIMEOUT_S = 300.0  # a process that cannot import the task within this is a setup error
FAILED = (0.0, True)


def _serve(conn, task_bytes: bytes) -> None:
    """A scoring process: (text, answer) in, (score, failed) out, until None or the pipe closes."""
    signal.signal(
        signal.SIGINT, signal.SIG_IGN
    )  # Ctrl-C reaches the whole process group: the trainer decides
    task = pickle.loads(task_bytes)
    task.prepare()  # imports and first-call costs are paid before the first deadline starts
    conn.send(None)  # ready
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        conn.send(task.score_unbounded(*msg))


class _Worker:
    def __init__(self, ctx, task_bytes: bytes):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, task_bytes), daemon=True)
        self.proc.start()
        child.close()
        # jobs: sent, not answered (the first is running); since: when it started (or, until ready, the spawn)
        self.ready, self.jobs, self.since = False, deque(), time.monotonic()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join()
        self.conn.close()


class ScoringPool:
    """`size` scoring processes holding a pickled copy of a task; `score` returns what `task.score_unbounded`
    would, with samples past the deadline or whose process died as (0.0, True)."""

    DEPTH = 4  # samples sent ahead to a process, so it does not wait for this one to wake up between samples

    def __init__(self, task, size: int, timeout_s: float):
        self._ctx = mp.get_context("spawn")  # not forked: the trainer may hold CUDA and engine workers
        self._task_bytes = pickle.dumps(task)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self.workers = [_Worker(self._ctx, self._task_bytes) for _ in range(size)]
        # one started process in reserve: a killed one is replaced at once, not after a cold start (seconds)
        self.spare = _Worker(self._ctx, self._task_bytes)
        self.killed = 0  # processes killed at the deadline or found dead (each cost its sample)

    def _replace(self, w: _Worker, todo: deque) -> None:
        """Kill `w` (its running sample has failed); the samples queued behind it, never started, go back."""
        w.jobs.popleft()
        todo.extendleft(reversed(w.jobs))
        w.kill()
        self.killed += 1
        self.workers[self.workers.index(w)], self.spare = self.spare, _Worker(self._ctx, self._task_bytes)

    def score(self, texts: list[str], answer: str) -> list[tuple[float, bool]]:
        with self._lock:
            results: list[tuple[float, bool] | None] = [None] * len(texts)
            todo = deque(range(len(texts)))
            while todo or any(w.jobs for w in self.workers):
                for w in self.workers:
                    while w.ready and len(w.jobs) < self.DEPTH and todo:
                        if not w.jobs:
                            w.since = time.monotonic()
                        w.jobs.append(todo.popleft())
                        try:
                            w.conn.send((texts[w.jobs[-1]], answer))
                        except (
                            OSError
                        ):  # it died meanwhile (BrokenPipeError): `_wait` sees it, this job goes back
                            break
                self._wait(results, todo)
            return results  # type: ignore[return-value]

    def _wait(self, results: list, todo: deque) -> None:
        """Wait for the next answer or deadline; record answers, failures and timeouts."""
        now, waits = time.monotonic(), []
        for w in self.workers:
            limit = STARTUP_TIMEOUT_S if not w.ready else self.timeout_s if w.jobs else 0
            if limit > 0:
                waits.append(w.since + limit - now)
        timeout = max(0.0, min(waits)) if waits else None
        answered = set(wait([w.conn for w in self.workers if not w.ready or w.jobs], timeout))
        for w in list(self.workers):
            if w.conn in answered:
                try:
                    msg = w.conn.recv()
                except (EOFError, OSError):  # the process died: its sample fails, never re-run
                    if not w.ready:
                        raise RuntimeError("a reward process died while starting (see its stderr)") from None
                    results[w.jobs[0]] = FAILED
                    self._replace(w, todo)
                    continue
                if not w.ready:
                    w.ready = True
                else:
                    results[w.jobs.popleft()], w.since = msg, time.monotonic()  # the next one starts now
            elif w.ready and w.jobs and self.timeout_s > 0:
                if time.monotonic() - w.since >= self.timeout_s:  # past the deadline: kill, do not wait
                    results[w.jobs[0]] = FAILED
                    self._replace(w, todo)
            elif not w.ready and time.monotonic() - w.since >= STARTUP_TIMEOUT_S:
                raise RuntimeError(f"a reward process did not start within {STARTUP_TIMEOUT_S:.0f} s")

    def close(self) -> None:
        """Ask each process to exit; kill those that do not within a second."""
        if self.spare is None:
            return
        everyone, self.spare = [*self.workers, self.spare], None
        for w in everyone:
            try:
                w.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for w in everyone:
            w.proc.join(timeout=1.0)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join()
            w.conn.close()
        self.workers = []
