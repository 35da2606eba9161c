"""The KV page pool on the host (no jax): free list, reference counts, and the prefix cache.

The device holds `num_pages + 1` pages per layer (`PagedKVCache`); page 0 is never handed out
(unused page-table entries point at it). A request owns the pages that hold its prompt and its
output (`pages_for`: prompt + max_tokens, reserved at admission, so a running request never
waits for memory). Pages are reference counted: samples of one prompt and requests with a
cached prefix map the same pages.

Prefix caching (exactness by construction, contract §2). A page's key is a chained hash over full
pages: parent key + the page's token ids + the shape of the prefill program that computed it
(the chunk length T: a row's arithmetic depends on the program's shape, so pages computed by
programs of different T are different pages) + the model snapshot. Prefill chunks start at
multiples of the chunk size from position 0, so a page at a given position is always computed
by the same program on the same inputs: a cache hit holds the very bits a fresh prefill would
write, and cached and uncached runs give the same tokens. Only prompt pages are cached (a page
that holds output was written by the decode step, another program). A request maps the longest
run of cached pages that ends on a chunk boundary and prefills the rest. Cached pages nobody
references stay until their memory is needed (LRU eviction).
"""

from __future__ import annotations

import collections
import hashlib
from typing import Callable, Optional, Sequence

import numpy as np

NULL_PAGE = 0


def page_keys(tokens: Sequence[int], page_size: int, chunk: int, chunk_len: Callable[[int], int],
              namespace: str) -> list[bytes]:
    """The chained keys of the full pages of `tokens` (a prompt): page j's key hashes page
    j - 1's key, its token ids, the length of the prefill program that writes it
    (`chunk_len(chunk index)`) and `namespace` (the model snapshot)."""
    keys, parent = [], namespace.encode()
    for j in range(len(tokens) // page_size):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(np.asarray(tokens[j * page_size:(j + 1) * page_size], np.int32).tobytes())
        h.update(int(chunk_len(j * page_size // chunk)).to_bytes(4, "little"))
        parent = h.digest()
        keys.append(parent)
    return keys


class PagePool:
    """`num_pages` allocatable pages (ids 1..num_pages), reference counted, with a prefix cache
    of full prompt pages keyed by `page_keys`."""

    def __init__(self, num_pages: int, page_size: int, prefix_cache: bool = True):
        self.num_pages, self.page_size, self.prefix_cache = num_pages, page_size, prefix_cache
        self.refs = np.zeros(num_pages + 1, np.int32)
        self.free: collections.deque[int] = collections.deque(range(1, num_pages + 1))
        self.cached: dict[bytes, int] = {}          # key -> page
        self.key_of: dict[int, bytes] = {}          # page -> key
        self.idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU
        self.queries = self.hits = 0                # prompt tokens looked up / served

    @property
    def used(self) -> int:
        """Pages held by requests (cached pages nobody references are free to take)."""
        return self.num_pages - len(self.free) - len(self.idle)

    def stats(self) -> dict:
        """pages_total, pages_used (held by requests), prefix_cache_queries (prompt tokens
        looked up) and prefix_cache_hits (served from the cache)."""
        return {"pages_total": self.num_pages, "pages_used": self.used,
                "prefix_cache_queries": self.queries, "prefix_cache_hits": self.hits}

    def available(self) -> int:
        return len(self.free) + len(self.idle)

    def lookup(self, keys: Sequence[bytes], usable: int) -> list[int]:
        """The cached pages of the longest prefix of `keys` of at most `usable` pages."""
        out: list[int] = []
        if not self.prefix_cache:
            return out
        for key in keys[:usable]:
            page = self.cached.get(key)
            if page is None:
                break
            out.append(page)
        return out

    def allocate(self, n: int) -> Optional[list[int]]:
        """n fresh pages (referenced once), evicting the least recently used idle cached pages
        when the free list runs out; None when n do not fit."""
        if n > self.available():
            return None
        out = []
        for _ in range(n):
            if self.free:
                page = self.free.popleft()
            else:
                page, _ = self.idle.popitem(last=False)
                del self.cached[self.key_of.pop(page)]
            self.refs[page] = 1
            out.append(page)
        return out

    def retain(self, pages: Sequence[int]) -> None:
        for page in pages:
            if self.refs[page] == 0:
                self.idle.pop(page, None)
            self.refs[page] += 1

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference of each page: an unreferenced cached page stays cached (idle,
        most recently used last), any other becomes free."""
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                if page in self.key_of:
                    self.idle[page] = None
                else:
                    self.free.append(page)

    def register(self, pages: Sequence[int], keys: Sequence[bytes]) -> None:
        """Cache computed prompt pages under their keys (a key already cached keeps its page)."""
        if not self.prefix_cache:
            return
        for page, key in zip(pages, keys):
            if key not in self.cached and page not in self.key_of:
                self.cached[key] = page
                self.key_of[page] = key

    def forget_prefixes(self) -> None:
        """Drop every prefix-cache entry (the weights changed, contract R4): idle cached pages
        become free, pages still held stay with their holders, uncached."""
        self.free.extend(self.idle)
        self.idle.clear()
        self.cached.clear()
        self.key_of.clear()

    def reset(self) -> None:
        """Forget every page (the device pool was dropped); the counters go on."""
        queries, hits = self.queries, self.hits
        self.__init__(self.num_pages, self.page_size, self.prefix_cache)
        self.queries, self.hits = queries, hits
