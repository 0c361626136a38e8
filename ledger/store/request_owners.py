"""Which sources may write a request's row: its owners (``request_sources``, migration 0009).

A request is run by one engine and proxied by at most one gateway (``requests.engine_source_id`` and
``gateway_source_id``). The first engine source and the first gateway source to name a request id own
it; what another source of the same kind sends about it is refused: not stored, not folded, and its
batch answered 409 ``not_request_owner`` naming the ids (the batch's other events are stored). So a
source holding the ingest token cannot rewrite another's requests: a ``finished`` it sent under a
victim's id set the victim's model and output tokens, and its ``tokens`` fed the victim's loop detector.

Owners are claimed per group, in the group's transaction: the ids a group names are looked up in
``KeyCache`` (the owners of the ids met lately); the rest, and ids whose owner of the group's kind is
not known yet (a gateway's request the engine names now), go to the backend's ``claim``, which stores
the group's claims where no owner is stored and answers the stored owners. On PostgreSQL that is one
``INSERT ... ON CONFLICT DO UPDATE ... RETURNING``, which takes each row's lock: two replicas claiming
one id wait on each other and both read the winner. What a group resolved enters the cache only after
its commit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from engine_hooks import events as ev
from ledger.store.request_keys import KeyCache

# A request's owners: (engine source id, gateway source id), None where no source of that kind named it.
Owners = tuple[str | None, str | None]
# (conn, the claims by id, in id order) -> the stored owners of every claimed id
Claim = Callable[[Any, dict[str, Owners]], dict[str, Owners]]

_STEP = ev.Step
_NO_REQUEST = frozenset({ev.Step, ev.Dropped})


def role(source: ev.Source) -> int:
    """The index of the source's kind in ``Owners``."""
    return 0 if source.kind == "engine" else 1


def named_ids(events: Sequence[Any]) -> set[str]:
    """The request ids ``events`` name (a step: the requests it ran and the ones it left stalled)."""
    ids: set[str] = set()
    add, update = ids.add, ids.update
    step, no_request = _STEP, _NO_REQUEST
    for e in events:
        cls = type(e)
        if cls is step:
            update(e.request_ids)
            update(e.stalled_request_ids)
        elif cls not in no_request:
            add(e.request_id)
    return ids


def foreign_ids(
    cache: KeyCache[Owners], conn: Any, batches: Sequence[ev.Batch], claim: Claim
) -> tuple[list[set[str]], dict[str, Owners]]:
    """Per batch, the ids it names that another source of its kind owns; and the owners the group's
    transaction resolved (for ``KeyCache.learn`` after the commit)."""
    named = [named_ids(b.events) for b in batches]
    wanted: dict[str, list[str | None]] = {}  # the group's first claimant of each kind, in batch order
    for b, ids in zip(batches, named, strict=True):
        r, sid = role(b.source), b.source.id
        for rid in ids:
            w = wanted.get(rid)
            if w is None:
                wanted[rid] = w = [None, None]
            if w[r] is None:
                w[r] = sid
    table, missing = cache.known(wanted)
    claims = {rid: (wanted[rid][0], wanted[rid][1]) for rid in missing}
    for rid, (engine, gateway) in table.items():
        w = wanted[rid]
        if (engine is None and w[0] is not None) or (gateway is None and w[1] is not None):
            claims[rid] = (w[0], w[1])  # a kind no one owns yet, claimed now
    resolved: dict[str, Owners] = {}
    if claims:
        resolved = claim(conn, dict(sorted(claims.items())))  # one lock order for every replica
        absent = [rid for rid in claims if rid not in resolved]
        if absent:
            raise RuntimeError(f"no owners stored for {len(absent)} claimed ids, e.g. {absent[0]!r}")
        table.update(resolved)
    foreign = []
    for b, ids in zip(batches, named, strict=True):
        r, sid = role(b.source), b.source.id
        foreign.append({rid for rid in ids if table[rid][r] != sid})
    return foreign, resolved


def names_any(e: Any, ids: set[str]) -> bool:
    """Whether event ``e`` names one of ``ids``."""
    if type(e) is _STEP:
        return not ids.isdisjoint(e.request_ids) or not ids.isdisjoint(e.stalled_request_ids)
    return type(e) not in _NO_REQUEST and e.request_id in ids
