"""An LRU cache of routed experts bounded by a byte budget, with optional read-ahead on one thread.

The budget bounds the bytes of cached experts plus reads in flight, counted exactly
(gate_up.nbytes + down.nbytes of each). Two things can hold memory beyond it, both stated:
an expert the running forward still uses after it was evicted (at most one per experts module
call: the loop holds one expert at a time), and the read buffer of a dtype conversion (a file in
bf16 read into an fp32 model briefly holds both).

Read-ahead (`prefetch`) starts reads on a single worker thread; a `get` for an expert still in flight
waits for that read instead of starting its own. A read that fails leaves the cache as it was (its
reserved bytes are released, nothing is inserted); a failed read-ahead is counted and the next `get`
of that expert reads again and raises the error itself.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Callable, Hashable

from ..errors import HfscaleError


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


class ExpertCache:
    """`load(key) -> tuple of tensors`, `size(key) -> bytes` (known before reading)."""

    def __init__(self, load: Callable[[Hashable], tuple], size: Callable[[Hashable], int], budget: int):
        self._load, self._size, self.budget = load, size, int(budget)
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._inflight: dict[Hashable, Future] = {}
        self._bytes = self._reserved = 0
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.stats = CacheStats()

    # ---------------------------------------------------------------- bookkeeping (lock held)
    def _evict_for(self, n: int) -> bool:
        """Evict least recently used entries until n more bytes fit; False if in-flight reads block it."""
        while self._bytes + self._reserved + n > self.budget and self._entries:
            _, ent = self._entries.popitem(last=False)
            self._bytes -= ent.nbytes
            self.stats.evictions += 1
            self.stats.prefetch_unused += ent.prefetched and not ent.used
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

    def _read(self, key, n: int):  # the loader's result, its size checked
        value = self._load(key)
        got = sum(t.nbytes for t in value)
        if got != n:
            raise HfscaleError(f"expert {key} read {got} bytes but its shape says {n}; the weights file does not "
                               "match the model's config: load the model again from its own directory")
        return value

    # ---------------------------------------------------------------- API
    def get(self, key):
        with self._lock:
            ent = self._entries.get(key)
            if ent is not None:
                return self._hit(key, ent)
            fut = self._inflight.get(key)
        if fut is not None:
            fut.exception()  # wait; a failed read-ahead falls through to a read of our own
            with self._lock:
                ent = self._entries.get(key)
                if ent is not None:
                    return self._hit(key, ent)
        n = self._size(key)
        with self._lock:
            self.stats.misses += 1
        self._reserve(n)
        return self._read_into(key, n, prefetched=False)

    def _hit(self, key, ent: _Entry):
        self._entries.move_to_end(key)
        self.stats.hits += 1
        if ent.prefetched and not ent.used:
            self.stats.prefetch_hits += 1
        ent.used = True
        return ent.value

    def _reserve(self, n: int) -> None:
        """Make room for a read of n bytes, waiting for read-aheads in flight if they hold the room."""
        while True:
            with self._lock:
                if self._evict_for(n) or not self._inflight:
                    self._reserved += n  # with nothing in flight, n alone fits (budget >= one expert, checked)
                    self._note_peak()
                    return
                waiting = list(self._inflight.values())
            for f in waiting:
                f.exception()

    def prefetch(self, keys) -> int:
        """Start reading `keys` that are neither cached nor in flight, while room can be made without
        waiting; returns how many were started."""
        started = 0
        for key in keys:
            n = self._size(key)
            with self._lock:
                if key in self._entries or key in self._inflight or not self._evict_for(n):
                    continue
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="hfscale-experts")
                self._reserved += n
                self._note_peak()
                self.stats.prefetched += 1
                self._inflight[key] = self._pool.submit(self._read_into, key, n, True)
                started += 1
        return started

    def _read_into(self, key, n: int, prefetched: bool):
        """Read n reserved bytes and insert them; on failure only the reservation is released."""
        try:
            value = self._read(key, n)
        except BaseException:
            with self._lock:
                self._reserved -= n
                self.stats.failed_reads += 1
                if prefetched:
                    del self._inflight[key]
            raise
        with self._lock:
            self._reserved -= n
            self._insert(key, value, n, prefetched=prefetched)
            if prefetched:
                del self._inflight[key]
        return value

    def drain(self) -> None:
        """Wait for every read-ahead in flight."""
        with self._lock:
            waiting = list(self._inflight.values())
        for f in waiting:
            f.exception()

    def clear(self) -> None:
        self.drain()
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def close(self) -> None:
        self.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

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
