"""A batch's output tokens carried by ``step`` events (schema 2), grouped by request for the rules.

A step names every request it ran; a batch of 8 steps of a busy engine holds about 2,000 entries,
each one request's tokens from one step. The rule engine wants them per request (its highest total,
its new ids in order), so each request is touched once per batch. Grouping them entry by entry in
Python cost more than the rules themselves; ``group`` does it with numpy (one dictionary lookup per
entry in C, a stable sort of the ids), and small batches, where numpy's fixed cost is larger, go
entry by entry (``group_small``); a columnar message's steps group from its columns
(``group_columns``). All give the same groups (a test compares them).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain, compress

import numpy as np

from engine_hooks import events as ev
from ledger.columnar import Steps

# Below this many entries (request ids of the steps with token columns), entry by entry is cheaper.
NUMPY_MIN_ENTRIES = 512

Group = tuple[str, int, list[int]]  # (request id, highest total, its new ids in order; [] when not sent)


def group(steps: Sequence[ev.Step]) -> list[Group]:
    """The requests that got output tokens from ``steps`` (in emit order), in order of first token."""
    steps = [s for s in steps if s.token_counts]
    n = sum(len(s.request_ids) for s in steps)
    if n < NUMPY_MIN_ENTRIES:
        return group_small(steps)
    counts_l = list(chain.from_iterable(s.token_counts for s in steps))
    rids = list(compress(chain.from_iterable(s.request_ids for s in steps), counts_l))
    counts = np.fromiter(compress(counts_l, counts_l), np.int64, len(rids))
    totals = np.fromiter(
        compress(chain.from_iterable(s.token_totals for s in steps), counts_l), np.int64, len(rids)
    )
    first_total = dict(zip(rids, totals.tolist(), strict=True))  # the requests, in order of first token
    index = {rid: i for i, rid in enumerate(first_total)}
    codes = np.fromiter(map(index.__getitem__, rids), np.int64, len(rids))
    highest = np.zeros(len(index), np.int64)
    np.maximum.at(highest, codes, totals)
    # The ids, grouped by request in emit order: the entries of steps that sent ids, each repeated
    # by its count, sorted stably by request.
    with_ids = np.fromiter(
        chain.from_iterable(
            compress([bool(s.token_ids)] * len(s.token_counts), s.token_counts) for s in steps
        ),
        bool,
        len(rids),
    )
    flat_ids = list(chain.from_iterable(s.token_ids for s in steps))
    if flat_ids:
        id_codes = np.repeat(codes[with_ids], counts[with_ids])
        ordered = np.asarray(flat_ids, np.int64)[np.argsort(id_codes, kind="stable")].tolist()
        per_request = np.bincount(id_codes, minlength=len(index)).tolist()
    else:
        ordered, per_request = [], [0] * len(index)
    out: list[Group] = []
    at = 0
    for rid, total, k in zip(index, highest.tolist(), per_request, strict=True):
        out.append((rid, total, ordered[at : at + k]))
        at += k
    return out


def group_small(steps: Sequence[ev.Step]) -> list[Group]:
    """``group``, entry by entry."""
    found: dict[str, tuple[list[int], list[int]]] = {}
    for s in steps:
        for rid, _count, total, ids in s.token_groups():
            got = found.get(rid)
            if got is None:
                found[rid] = ([total], list(ids))
            else:
                if total > got[0][0]:
                    got[0][0] = total
                got[1].extend(ids)
    return [(rid, total[0], ids) for rid, (total, ids) in found.items()]


def group_columns(steps: Steps, ids: list[str]) -> list[Group]:
    """``group`` of a columnar message's steps, straight from its columns (request keys indexing
    ``ids``): no Python per entry."""
    counts = steps.values["token_counts"]
    if not len(counts):
        return []
    lens = steps.lengths
    carried = np.repeat(lens[3] > 0, lens[0])  # entries of steps with token columns
    got = counts > 0
    keys = steps.values["request_keys"][carried][got]
    totals = steps.values["token_totals"][got].astype(np.int64)
    if not len(keys):
        return []
    uniq, first = np.unique(keys, return_index=True)
    firsts = uniq[np.argsort(first, kind="stable")]  # the requests' keys in order of first token
    code = np.zeros(len(ids), np.int64)
    code[firsts] = np.arange(len(firsts))
    codes = code[keys]
    highest = np.zeros(len(firsts), np.int64)
    np.maximum.at(highest, codes, totals)
    flat_ids = steps.values["token_ids"]
    if len(flat_ids):
        sent = np.repeat(lens[5] > 0, lens[0])[carried][got]  # entries of steps that sent ids
        id_codes = np.repeat(codes[sent], counts[got][sent])
        ordered = flat_ids[np.argsort(id_codes, kind="stable")].tolist()
        per_request = np.bincount(id_codes, minlength=len(firsts)).tolist()
    else:
        ordered, per_request = [], [0] * len(firsts)
    out: list[Group] = []
    at = 0
    for key, total, k in zip(firsts.tolist(), highest.tolist(), per_request, strict=True):
        out.append((ids[key], total, ordered[at : at + k]))
        at += k
    return out
