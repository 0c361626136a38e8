"""The integer keys steps store for the requests they ran (``request_keys``, migration 0007).

A group's steps name a few hundred distinct requests, each in many steps. The writer turns each
step's ids into keys with one dictionary lookup per entry: the keys of the ids it met lately are in
``KeyCache``; the rest are resolved once per group (``keys_for``), in the group's transaction, by the
backend's ``insert`` (new keys for ids never named before: the usual case, requests whose first step
this is; DuckDB draws them from its writer's counter, PostgreSQL from ``request_key_seq``) and then
its ``lookup`` for the ids another writer or an earlier run named. What was resolved enters the cache
only after the commit (``learn``), so a rolled-back group leaves no key behind that the database does
not hold.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import pairwise
from typing import Any, Generic, TypeVar

import numpy as np

from ledger.columnar import Columns

# ids -> their keys, for the ids a transaction resolves; a backend's insert or lookup
Resolver = Callable[[Any, list[str]], dict[str, int]]
V = TypeVar("V")


class KeyCache(Generic[V]):
    """What the ids met lately map to (their keys; their owners in ``ledger.store.request_owners``), in
    two generations of at most ``size`` ids each.

    A lookup that finds an id in the old generation moves it to the young one; when the young one is
    full it becomes the old one (the old one is dropped). So a request named in every step stays,
    and memory is bounded by ``2 * size`` ids whatever the traffic (about 150 bytes each).
    """

    def __init__(self, size: int = 1 << 18) -> None:
        self.size = size
        self._young: dict[str, V] = {}
        self._old: dict[str, V] = {}

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def known(self, ids: Iterable[str]) -> tuple[dict[str, V], list[str]]:
        """The values of ``ids`` (distinct) found here, and the ids not found."""
        young, old = self._young, self._old
        found: dict[str, V] = {}
        missing: list[str] = []
        promoted: dict[str, V] = {}
        for rid in ids:
            key = young.get(rid)
            if key is None:
                key = old.get(rid)
                if key is None:
                    missing.append(rid)
                    continue
                promoted[rid] = key
            found[rid] = key
        if promoted:
            self.learn(promoted)
        return found, missing

    def peek(self, rid: str) -> V | None:
        """What ``rid`` maps to, if met lately (no promotion: for a lookup that does not use it)."""
        found = self._young.get(rid)
        return found if found is not None else self._old.get(rid)

    def learn(self, keys: dict[str, V]) -> None:
        """Remember ``keys`` (after the transaction that resolved them committed)."""
        if len(self._young) + len(keys) > self.size:
            self._old, self._young = self._young, {}
        self._young.update(keys)


def keys_for(
    cache: KeyCache[int],
    conn: Any,
    id_lists: Sequence[list[str] | Columns],
    insert: Resolver,
    lookup: Resolver,
) -> tuple[list[list[int]], dict[str, int], list[np.ndarray]]:
    """Each list of ids as keys (a columnar message stands for the lists of all its steps: its ids are
    looked up once each and its steps' keys gathered with numpy), the keys resolved in ``conn``
    (for ``KeyCache.learn`` after the commit), and per columnar message the keys of its ids (what
    names its requests across the group's fold). ``insert`` draws keys for the ids not stored yet;
    ``lookup`` finds the others'."""
    wanted: set[str] = set()
    lists: list[list[str]] = []
    for part in id_lists:
        if isinstance(part, Columns):
            wanted.update(part.ids)
        else:
            lists.append(part)
    wanted = wanted.union(*lists)
    table, missing = cache.known(wanted)
    resolved: dict[str, int] = {}
    if missing:
        # In one order for every writer: two PostgreSQL replicas inserting the same new ids wait on
        # each other's rows in the same order, so they cannot deadlock.
        missing.sort()
        resolved = insert(conn, missing)
        if len(resolved) < len(missing):
            resolved.update(lookup(conn, [rid for rid in missing if rid not in resolved]))
        absent = [rid for rid in missing if rid not in resolved]
        if absent:  # the insert and the lookup together must account for every id
            raise RuntimeError(f"no request key for {len(absent)} ids, e.g. {absent[0]!r}")
        table.update(resolved)
    get = table.__getitem__
    out: list[list[int]] = []
    codes: list[np.ndarray] = []
    for part in id_lists:
        if isinstance(part, Columns):
            key_of = np.fromiter(map(get, part.ids), np.int64, len(part.ids))
            codes.append(key_of)
            keys = key_of[part.steps.values["request_keys"]].tolist()
            out += [keys[a:b] for a, b in pairwise(part.steps.offsets("request_keys").tolist())]
        else:
            out.append(list(map(get, part)))
    return out, resolved, codes
