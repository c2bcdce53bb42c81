"""A directory's files read on forked processes, the results streamed back in their order.

``ls DIR``, ``verify DIR`` (structure) and ``prune --damaged`` read every file on its own: a
process's layout cache (slotfile.format.layout_cache) only ever holds shapes re-checked against
each file's bytes, so which process reads a file changes nothing in what is read.  From
:data:`PARALLEL_MIN` files on, :func:`ordered_map` forks :func:`dir_jobs` workers (2 by
default: ``$SLOTFILE_DIR_JOBS`` or the caller's ``--jobs`` say otherwise) and hands them the
files in chunks of :data:`CHUNK`, at most :data:`WINDOW` chunks ahead of what the caller has
taken: results come back in the files' order as they are made, so the caller can write each
row and drop it (memory flat in the number of files).

Within a chunk each worker takes a band of file sizes (cut at the size quantiles of a bounded
sample of the files so far, each band held within a quarter of the chunk of an even share): a body size's layout is
searched for once, in the worker that keeps that size, not in every worker.
"""

from __future__ import annotations

import os
import sys
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import chain, islice
from typing import Any

PARALLEL_MIN = 200  # files: below this a second process costs more than it saves
JOBS_ENV = "SLOTFILE_DIR_JOBS"  # processes a directory's files are read with (default: DEFAULT_JOBS)
DEFAULT_JOBS = 2  # at most, and no more than the CPUs this process may run on
CHUNK = 32  # files per chunk: small enough to stream, large enough to amortise a message
SAMPLE = 4096  # sizes the split's bounds are taken from (a reservoir: bounded, whatever the files)
WINDOW = 6  # chunks in flight ahead of the one being taken (task messages stay far below a socket's buffer)


class WorkerLost(RuntimeError):
    """A worker process ended (killed, out of memory, a crash in native code) or failed while
    reading some of the files: the command cannot finish its listing.  The CLI reports it as an
    operational error (exit 8), naming the files the worker held."""


def dir_jobs(jobs: int | None = None) -> int:
    """The processes a directory's files are read with: ``jobs`` when given (``verify --jobs``),
    else ``$SLOTFILE_DIR_JOBS``, else 2 (or 1 on a single CPU)."""
    if jobs is not None:
        return max(1, jobs)
    try:
        return max(1, int(os.environ[JOBS_ENV]))
    except (KeyError, ValueError):
        pass
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(DEFAULT_JOBS, cpus))


def can_fork() -> bool:
    """Whether forked workers are safe here: ``os.fork`` and not macOS (whose system libraries
    may not survive a fork; Python itself stopped forking there by default), and no other
    thread running (a thread holding a lock at the fork would leave it held in the child)."""
    import threading

    return hasattr(os, "fork") and sys.platform != "darwin" and threading.active_count() == 1


def ordered_map(
    fn: Callable[[list[Any]], list[Any]], pairs: Iterable[tuple[Any, int]], jobs: int | None = None
) -> Iterator[Any]:
    """``fn`` (a list of items to a list of results, one each, never raising) over the items of
    ``pairs`` (each item with its file size), the results yielded in the items' order.  The
    pairs are taken as they are needed (a walk of DIR may make them as it goes): at most
    :data:`WINDOW` chunks ahead of the result being taken are held.  Serial in this process for
    fewer than :data:`PARALLEL_MIN` items, one job, or where forking is unsafe; else the
    workers are forked once the first :data:`PARALLEL_MIN` items are in (before the caller
    starts a progress bar's thread) and fed as the results are taken."""
    jobs = dir_jobs(jobs)
    it = iter(pairs)
    head = list(islice(it, max(PARALLEL_MIN, jobs * (PARALLEL_MIN // 2))))
    n = min(jobs, len(head) // (PARALLEL_MIN // 2) or 1)
    if n < 2 or len(head) < PARALLEL_MIN or not can_fork():
        return _serial(fn, chain(head, it))
    return _Forked(fn, head, it, n).results()


def _serial(fn: Callable[[list[Any]], list[Any]], pairs: Iterator[tuple[Any, int]]) -> Iterator[Any]:
    while chunk := [item for item, _ in islice(pairs, CHUNK)]:
        yield from fn(chunk)


def split_chunk(idx: Sequence[int], sizes: Sequence[int], bounds: Sequence[int], n: int) -> list[list[int]]:
    """The items ``idx`` of one chunk for ``n`` workers: sorted by size and cut where the sizes
    cross ``bounds`` (the sizes' quantiles: :class:`SizeSample`), each cut held within a quarter of the
    chunk of an even split (so no worker waits long on another)."""
    order = sorted(idx, key=lambda i: sizes[i])
    m, slack = len(order), max(1, len(order) // 4)
    cuts, prev = [0], 0
    for j in range(1, n):
        even = j * m // n
        below = sum(1 for i in order if sizes[i] < bounds[j - 1])
        cut = max(prev, min(max(below, even - slack), even + slack, m))
        cuts.append(cut)
        prev = cut
    cuts.append(m)
    return [sorted(order[cuts[j] : cuts[j + 1]]) for j in range(n)]


class SizeSample:
    """The sizes' quantiles from a bounded sample of them (:data:`SAMPLE` sizes, a seeded
    reservoir: the same directory is split the same way on every run), the bounds
    :func:`split_chunk` cuts a chunk at.  A walk's sizes are not all known ahead, nor held."""

    def __init__(self, n: int) -> None:
        import random

        self.n, self.seen, self.kept = n, 0, array("q")
        self._rng = random.Random(0)
        self._bounds: list[int] | None = None
        self._since = 0  # sizes added since the bounds were taken

    def add(self, size: int) -> None:
        self.seen += 1
        self._since += 1
        if len(self.kept) < SAMPLE:
            self.kept.append(size)
            return
        j = self._rng.randrange(self.seen)
        if j < SAMPLE:
            self.kept[j] = size

    def bounds(self) -> list[int]:
        """The quantiles, taken again once an eighth more sizes came in (sorting the sample
        for every chunk cost ~0.85 ms, ~27 us a file in the process writing the rows)."""
        if self._bounds is None or self._since >= max(CHUNK, self.seen // 8):
            ranked = sorted(self.kept)
            self._bounds = (
                [ranked[j * len(ranked) // self.n] for j in range(1, self.n)] if ranked else [0] * (self.n - 1)
            )
            self._since = 0
        return self._bounds


class _Chunk:
    """Up to :data:`CHUNK` items with their sizes, and how they were split among the workers."""

    __slots__ = ("items", "sizes", "split")

    def __init__(self, pairs: list[tuple[Any, int]]) -> None:
        self.items = [item for item, _ in pairs]
        self.sizes = [size for _, size in pairs]
        self.split: list[list[int]] = []


class _Forked:
    """The workers of one :func:`ordered_map`: each a forked process on one end of a socket
    pair, taking lists of items and answering ``(True, results)`` or ``(False, traceback)``."""

    def __init__(
        self, fn: Callable[[list[Any]], list[Any]], head: list[tuple[Any, int]], rest: Iterator[tuple[Any, int]], n: int
    ):
        self.pairs, self.n = chain(head, rest), n
        self.sample = SizeSample(n)
        for _, size in head:
            self.sample.add(size)
        self.taken, self.n_head = 0, len(head)  # pairs taken into chunks; the first n_head are sampled
        self.conns: list[Any] = []
        self.pids: list[int] = []
        self._start(fn)

    def _start(self, fn: Callable[[list[Any]], list[Any]]) -> None:
        import gc
        from multiprocessing import Pipe

        for f in (sys.stdout, sys.stderr):  # a child never writes what the parent had buffered
            f.flush()
        # the objects made so far (modules, the grammar, the first files) set aside from the
        # cyclic collector: a worker's collections would walk them all, writing to every page
        # it shares with the parent (gc.freeze's purpose); 15-20 % of a worker's CPU otherwise
        gc.freeze()
        try:
            self._fork(fn, Pipe)
        finally:
            gc.unfreeze()  # in this process, as before

    def _fork(self, fn: Callable[[list[Any]], list[Any]], pipe: Callable[..., Any]) -> None:
        for _ in range(self.n):
            mine, theirs = pipe(duplex=True)
            pid = os.fork()
            if pid == 0:  # the worker
                code = 1
                try:
                    mine.close()
                    for c in self.conns:
                        c.close()
                    _serve(fn, theirs)
                    code = 0
                finally:
                    os._exit(code)  # no atexit, no flush of the parent's streams
            theirs.close()
            self.conns.append(mine)
            self.pids.append(pid)

    def results(self) -> Iterator[Any]:
        sent: deque[_Chunk] = deque()
        done = False
        try:
            for _ in range(WINDOW):
                if not self._send_next(sent):
                    break
            while sent:
                chunk = sent.popleft()
                got: dict[int, Any] = {}
                for w, idx in enumerate(chunk.split):
                    if idx:
                        got.update(zip(idx, self._recv(w, chunk, idx), strict=True))
                self._send_next(sent)
                for i in range(len(chunk.items)):
                    yield got[i]
            done = True
        finally:
            self._stop(done)

    def _send_next(self, sent: deque[_Chunk]) -> bool:
        """The next chunk of the pairs split and sent (False: none left)."""
        pairs = list(islice(self.pairs, CHUNK))
        if not pairs:
            return False
        chunk = _Chunk(pairs)
        for size in chunk.sizes:
            self.taken += 1
            if self.taken > self.n_head:  # the head's sizes were sampled when it was taken
                self.sample.add(size)
        chunk.split = split_chunk(range(len(pairs)), chunk.sizes, self.sample.bounds(), self.n)
        for conn, idx in zip(self.conns, chunk.split, strict=True):
            if idx:
                try:
                    conn.send([chunk.items[i] for i in idx])
                except OSError:
                    # the worker has ended (EPIPE): its earliest chunk not yet taken says so, with
                    # its files, when it is taken (_recv); raised here, the OSError would reach
                    # click, which ends the command with exit 1 and no word for a broken pipe
                    pass
        sent.append(chunk)
        return True

    def _recv(self, w: int, chunk: _Chunk, idx: list[int]) -> list[Any]:
        """Worker ``w``'s results for the items ``idx`` of ``chunk``; :class:`WorkerLost`
        naming them when it ended or failed instead."""
        try:
            ok, got = self.conns[w].recv()
        except (EOFError, OSError):
            raise WorkerLost(f"a directory worker process ended ({self._end_of(w)}) {_reading(chunk, idx)}") from None
        if not ok:
            raise WorkerLost(f"a directory worker process failed {_reading(chunk, idx)}:\n{got}")
        return list(got)

    def _end_of(self, w: int) -> str:
        """How worker ``w`` ended (reaped here; :meth:`_stop` skips it then)."""
        pid, self.pids[w] = self.pids[w], 0
        status = os.waitpid(pid, 0)[1]
        code = os.waitstatus_to_exitcode(status)
        if code < 0:
            import signal

            return f"killed by {signal.Signals(-code).name}"
        return f"exit status {code}"

    def _stop(self, done: bool) -> None:
        """Each worker told to end (all taken) or killed (the caller stopped early), and reaped."""
        import signal

        for conn, pid in zip(self.conns, self.pids, strict=True):
            try:
                if done:
                    conn.send(None)
                elif pid:
                    os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
            conn.close()
        for pid in self.pids:
            if pid:  # 0: reaped already (_end_of)
                os.waitpid(pid, 0)


def _reading(chunk: _Chunk, idx: list[int]) -> str:
    first = chunk.items[idx[0]]
    name = getattr(first, "path", first)
    more = f" and {len(idx) - 1} more" if len(idx) > 1 else ""
    return f"while it held {name}{more}"


def _serve(fn: Callable[[list[Any]], list[Any]], conn: Any) -> None:
    """A worker: lists of items in, their results out, until None."""
    import traceback

    while True:
        try:
            items = conn.recv()
        except EOFError:
            return
        if items is None:
            return
        try:
            out: tuple[bool, Any] = (True, fn(items))
        except Exception:  # said by the parent, with the worker's traceback
            out = (False, traceback.format_exc())
        conn.send(out)
