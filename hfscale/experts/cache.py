"""An LRU cache of routed experts bounded by a byte budget, with reads on one background thread.

The budget bounds the bytes of cached experts plus reads in flight, counted exactly
(gate_up.nbytes + down.nbytes of each). Three things can hold memory beyond it, all stated:
experts the running forward still uses after they were evicted (at most one layer's routed experts:
`get_many` hands a layer's experts out together), up to two evicted experts' buffers kept for the
next read to reuse (hfscale.experts.offload, pread reader), and the read buffer of a dtype conversion
(a file in bf16 read into an fp32 model briefly holds both).

Reads: `get` reads a missing expert on the caller's thread; `get_many(keys)` (one MoE layer's routed
experts) hands out the cached ones at once, under one lock, then reads the others. Read-ahead
(`prefetch`) runs on one worker thread; a request for an expert still in flight waits for that read
instead of starting its own. With `read_timeout_s` every read runs on the worker thread and a wait
longer than that raises HfscaleError (the read goes on and is cached when it completes; the worker is
a daemon thread, so a hung read does not hang exit). Reading the missing experts on the worker while
the caller computes with the cached ones was measured slower on this 2-core host (one torch thread,
other jobs running: 0.67-0.75x the tokens/s of reading them on the caller's thread), so it is done only
where the timeout needs the worker.

A read that fails leaves the cache as it was (its reserved bytes are released, nothing is inserted) and
raises; a failed read-ahead is counted and the next request of that expert reads again and raises the
error itself. `on_evict(key, value)` is told of every eviction (the offload recycles read buffers).
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass
from typing import Callable, Hashable

from ..util.errors import HfscaleError


@dataclass
class CacheStats:
    hits: int = 0                # requests served from the cache (or from a read-ahead already in flight)
    misses: int = 0              # requests that had to read
    prefetched: int = 0          # read-aheads started
    prefetch_hits: int = 0       # requests served by a read-ahead (counted in hits too)
    prefetch_unused: int = 0     # read-aheads evicted before any request used them
    evictions: int = 0
    reads: int = 0               # expert reads completed (misses + read-aheads)
    bytes_read: int = 0
    failed_reads: int = 0
    timeouts: int = 0            # waits that gave up after read_timeout_s
    peak_bytes: int = 0          # most bytes cached + in flight at once

    @property
    def hit_rate(self) -> float:
        asked = self.hits + self.misses
        return self.hits / asked if asked else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "hit_rate": round(self.hit_rate, 4)}


@dataclass
class _Entry:
    value: tuple
    nbytes: int
    prefetched: bool = False
    used: bool = False


class _Worker:
    """One daemon thread running submitted calls in order (a ThreadPoolExecutor's threads are joined at
    interpreter exit, so one hung read would hang the process's exit)."""

    def __init__(self):
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="hfscale-experts", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            fut, fn, args = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                fut.set_exception(e)

    def submit(self, fn, *args) -> Future:
        fut: Future = Future()
        self._q.put((fut, fn, args))
        return fut

    def shutdown(self, timeout: float | None = None) -> None:
        self._q.put(None)
        self._thread.join(timeout)


class ExpertCache:
    """`load(key) -> tuple of tensors`, `size(key) -> bytes` (known before reading); `describe(key)` names
    an expert in a timeout message."""

    def __init__(self, load: Callable[[Hashable], tuple], size: Callable[[Hashable], int], budget: int,
                 read_timeout_s: float | None = None, on_evict: Callable | None = None,
                 describe: Callable[[Hashable], str] = str):
        if read_timeout_s is not None and not 0 < read_timeout_s < 1e6:
            raise HfscaleError(f"read_timeout_s must be a positive number of seconds below 1e6, or None to wait "
                               f"(got {read_timeout_s!r})")
        self._load, self._size, self.budget = load, size, int(budget)
        self.read_timeout_s, self._on_evict, self._describe = read_timeout_s, on_evict, describe
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._inflight: dict[Hashable, Future] = {}
        self._bytes = self._reserved = 0
        self._lock = threading.Lock()
        self._worker: _Worker | None = None
        self.stats = CacheStats()

    # ---------------------------------------------------------------- bookkeeping (lock held)
    def _evict_for(self, n: int) -> bool:
        """Evict least recently used entries until n more bytes fit; False if in-flight reads block it."""
        while self._bytes + self._reserved + n > self.budget and self._entries:
            key, ent = self._entries.popitem(last=False)
            self._bytes -= ent.nbytes
            self.stats.evictions += 1
            self.stats.prefetch_unused += ent.prefetched and not ent.used
            if self._on_evict is not None:
                self._on_evict(key, ent.value)
        return self._bytes + self._reserved + n <= self.budget

    def _insert(self, key, value, n: int, prefetched: bool) -> None:
        old = self._entries.pop(key, None)  # a second read of the same expert replaces the first
        if old is not None:
            self._bytes -= old.nbytes
        self._entries[key] = _Entry(value, n, prefetched, used=not prefetched)
        self._bytes += n
        self.stats.reads += 1
        self.stats.bytes_read += n

    def _note_peak(self) -> None:
        self.stats.peak_bytes = max(self.stats.peak_bytes, self._bytes + self._reserved)

    def _hit(self, key, ent: _Entry):
        self._entries.move_to_end(key)
        self.stats.hits += 1
        if ent.prefetched and not ent.used:
            self.stats.prefetch_hits += 1
        ent.used = True
        return ent.value

    def _start(self, key, n: int, prefetched: bool) -> Future:
        """Reserve n bytes (room already made) and queue the read on the worker thread."""
        if self._worker is None:
            self._worker = _Worker()
        self._reserved += n
        self._note_peak()
        fut = self._inflight[key] = self._worker.submit(self._read_into, key, n, prefetched)
        return fut

    # ---------------------------------------------------------------- reading
    def _read(self, key, n: int):  # the loader's result, its size checked
        value = self._load(key)
        got = sum(t.nbytes for t in value)
        if got != n:
            raise HfscaleError(f"expert {key} read {got} bytes but its shape says {n}; the weights file does not "
                               "match the model's config: load the model again from its own directory")
        return value

    def _read_into(self, key, n: int, prefetched: bool):
        """Read n reserved bytes and insert them; on failure only the reservation is released. A read
        started by `_start` is in `_inflight` until it ends, either way."""
        try:
            value = self._read(key, n)
        except BaseException:
            with self._lock:
                self._reserved -= n
                self.stats.failed_reads += 1
                self._inflight.pop(key, None)
            raise
        with self._lock:
            self._reserved -= n
            self._insert(key, value, n, prefetched=prefetched)
            self._inflight.pop(key, None)
        return value

    def _wait(self, key, fut: Future):
        """The result of a read in flight, within read_timeout_s."""
        try:
            return fut.result(timeout=self.read_timeout_s)
        except FutureTimeout:
            with self._lock:
                self.stats.timeouts += 1
            raise HfscaleError(f"reading {self._describe(key)} took longer than read_timeout_s={self.read_timeout_s:g} s; "
                               "the storage is too slow or hung: move the model to local storage or raise "
                               "read_timeout_s (--read-timeout); the read goes on and is cached if it completes") from None

    def _reserve(self, n: int) -> None:
        """Make room for a read of n bytes, waiting for reads in flight if they hold the room."""
        while True:
            with self._lock:
                if self._evict_for(n) or not self._inflight:
                    self._reserved += n  # with nothing in flight, n alone fits (budget >= one expert, checked)
                    self._note_peak()
                    return
                waiting = list(self._inflight.items())
            for key, f in waiting:
                self._settle(key, f)

    def _settle(self, key, fut: Future) -> None:
        """Wait for a read in flight (within the timeout); its own failure is not ours to raise."""
        try:
            self._wait(key, fut)
        except HfscaleError:
            if not fut.done():
                raise
        except BaseException:  # noqa: BLE001 - a failed read-ahead: the request for it raises
            pass

    # ---------------------------------------------------------------- API
    def get(self, key):
        with self._lock:
            ent = self._entries.get(key)
            if ent is not None:
                return self._hit(key, ent)
            fut = self._inflight.get(key)
        if fut is not None:
            self._settle(key, fut)  # a failed read-ahead falls through to a read of our own
            with self._lock:
                ent = self._entries.get(key)
                if ent is not None:
                    return self._hit(key, ent)
        n = self._size(key)
        with self._lock:
            self.stats.misses += 1
        if self.read_timeout_s is None:
            self._reserve(n)
            return self._read_into(key, n, prefetched=False)
        while True:  # timed: the read runs on the worker, this thread waits for it
            with self._lock:
                fut = self._inflight.get(key)
                if fut is None and (self._evict_for(n) or not self._inflight):
                    fut = self._start(key, n, prefetched=False)
                waiting = None if fut is not None else list(self._inflight.items())
            if fut is not None:
                return self._wait(key, fut)
            for k, f in waiting:
                self._settle(k, f)

    def get_many(self, keys):
        """Yield (key, value) for each of `keys` (distinct): the cached ones first (one lock), then the others.
        Those are read on this thread one after the other, or, with read_timeout_s, queued on the worker
        thread at once (while room can be made without waiting) and waited for within the timeout.
        Requests are counted as `get` counts them."""
        ready, pending, later = [], [], []
        with self._lock:
            for key in keys:
                ent = self._entries.get(key)
                if ent is not None:
                    ready.append((key, self._hit(key, ent)))
                elif self.read_timeout_s is None or key in self._inflight:
                    later.append(key)  # read here, or a read-ahead in flight: a hit when it lands
                else:
                    n = self._size(key)
                    if self._evict_for(n):
                        self.stats.misses += 1
                        pending.append((key, self._start(key, n, prefetched=False)))
                    else:
                        later.append(key)
        while ready:  # handed out and let go one by one
            yield ready.pop()
        for key, fut in pending:
            yield key, self._wait(key, fut)
        for key in later:
            yield key, self.get(key)

    def prefetch(self, keys) -> int:
        """Start reading `keys` that are neither cached nor in flight, while room can be made without
        waiting; returns how many were started."""
        started = 0
        for key in keys:
            n = self._size(key)
            with self._lock:
                if key in self._entries or key in self._inflight or not self._evict_for(n):
                    continue
                self.stats.prefetched += 1
                self._start(key, n, prefetched=True)
                started += 1
        return started

    def drain(self, forever: bool = False) -> None:
        """Wait for every read in flight: within read_timeout_s each, or as long as they take (`forever`)."""
        with self._lock:
            waiting = list(self._inflight.items())
        for key, f in waiting:
            if forever:
                f.exception()
            else:
                self._settle(key, f)

    def clear(self) -> None:
        self.drain()
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def close(self) -> None:
        self.clear()
        if self._worker is not None:
            self._worker.shutdown(timeout=self.read_timeout_s)
            self._worker = None

    @property
    def cached_bytes(self) -> int:
        return self._bytes

    def cached_keys(self) -> list:
        with self._lock:
            return list(self._entries)

    def check(self) -> None:
        """The invariants a failure must not break (tests call it)."""
        with self._lock:
            assert self._bytes == sum(e.nbytes for e in self._entries.values()), "cached bytes drifted"
            assert self._reserved == sum(self._size(k) for k in self._inflight), "reserved bytes drifted"
            assert self._bytes + self._reserved <= self.budget, "over budget"
