"""Fold events into per-request ledger rows, independent of arrival order.

Every column of a ``requests`` row is an aggregate with a commutative, associative merge: the minimum
(first time something happened), the maximum (last time, or a running total reported by the source),
or a sum (counts and measured durations). A request's row is therefore the merge of the partial rows of
its events, in any order and from any number of sources, and the ledger can upsert partial rows
batch by batch: ``row = merge(row, partial)``. Replays cannot double-count because events are
deduplicated by ``(source_id, seq)`` before they are folded.

Derived values (the four layers of attribution) are computed from the merged columns, never stored
by the fold itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from engine_hooks import events as ev
from ledger.columnar import Steps, steps_of

Op = Literal["min", "max", "sum"]
ColType = Literal["float", "int", "str"]


@dataclass(frozen=True)
class Agg:
    op: Op
    type: ColType
    doc: str


# Column name -> how it merges. The order is the column order of the requests table.
AGGREGATES: dict[str, Agg] = {
    "model": Agg("max", "str", "served model (from the engine source)"),
    "engine_source_id": Agg("max", "str", "engine source that ran the request"),
    "gateway_source_id": Agg("max", "str", "gateway source that proxied it"),
    # Lifecycle points (source wall clock, unix seconds).
    "arrived_ts": Agg("min", "float", "gateway received the request"),
    "admission_enqueued_ts": Agg("min", "float", "entered the gateway admission queue"),
    "admitted_ts": Agg("min", "float", "gateway forwarded it to the engine"),
    "engine_arrival_ts": Agg("min", "float", "engine front end received it"),
    "queued_ts": Agg("min", "float", "engine scheduler queued it"),
    "first_scheduled_ts": Agg("min", "float", "first prefill chunk scheduled"),
    "first_token_ts": Agg("min", "float", "first output token"),
    "last_token_ts": Agg("max", "float", "last output token"),
    "finished_ts": Agg("min", "float", "engine finished it"),
    "first_byte_ts": Agg("min", "float", "gateway saw the first response byte"),
    "completed_ts": Agg("min", "float", "gateway finished the response"),
    "disconnected_ts": Agg("min", "float", "client disconnected"),
    "stream_cut_ts": Agg("min", "float", "gateway cut the stream on a command"),
    "last_event_ts": Agg("max", "float", "newest event of the request"),
    # Durations measured by the sources' monotonic clocks (seconds).
    "entry_measured_s": Agg("sum", "float", "gateway: arrived -> admission queue"),
    "admission_wait_s": Agg("sum", "float", "gateway: time in the admission queue"),
    "backend_wait_measured_s": Agg("sum", "float", "engine: queued -> scheduled, plus preempted -> resumed"),
    # Token ledger.
    "prompt_tokens": Agg("max", "int", "prompt length"),
    "max_tokens": Agg("max", "int", "output cap the client asked for"),
    "cached_tokens": Agg("sum", "int", "prefix-cache hits when first scheduled"),
    "prefill_computed_tokens": Agg("sum", "int", "prompt tokens computed for the first time"),
    "recomputed_tokens": Agg("sum", "int", "tokens computed again after preemptions"),
    "output_tokens": Agg("max", "int", "output tokens produced"),
    "chunks": Agg("sum", "int", "prefill chunks (all passes)"),
    "preemptions": Agg("sum", "int", "times preempted"),
    "resumes": Agg("sum", "int", "times resumed after a preemption"),
    "kv_blocks_max": Agg("max", "int", "most KV blocks held at once"),
    "token_events": Agg("sum", "int", "tokens events (coalesced groups of output tokens)"),
    "events": Agg("sum", "int", "events folded into this row"),
    # Outcome.
    "finish_reason": Agg("max", "str", "stop | length | abort | cutoff | error"),
    "stop_reason": Agg("max", "str", "engine stop reason, e.g. chunkledger:<rule>"),
    "status_code": Agg("max", "int", "HTTP status the gateway sent"),
    "cut_rule": Agg("max", "str", "rule of the cutoff applied to it"),
    # Waits split by what they delayed (for attribution; monotonic, seconds).
    "requeue_wait_prefill_s": Agg("sum", "float", "preempted -> resumed waits before the first token"),
    "requeue_wait_decode_s": Agg("sum", "float", "preempted -> resumed waits after the first token"),
    "final_wait_s": Agg("sum", "float", "wait that ended with the request finishing while waiting"),
    # Step participation and KV idle time, folded from ``step`` events.
    "step_count": Agg("sum", "int", "engine steps it took part in (a chunk or a decode)"),
    "active_s": Agg("sum", "float", "summed duration of the steps it took part in"),
    "last_step_ts": Agg("max", "float", "end of the last step it took part in"),
    "stalled_steps": Agg("sum", "int", "steps it sat out while holding KV blocks"),
    "kv_idle_s": Agg("sum", "float", "seconds holding KV blocks with no progress (steps sat out)"),
    "kv_idle_block_s": Agg("sum", "float", "KV block-seconds held idle (blocks x seconds sat out)"),
    # What the client saw: generated content written to it by the gateway (migration 0006).
    "first_token_out_ts": Agg("min", "float", "gateway wrote the first generated content to the client"),
    "last_token_out_ts": Agg("max", "float", "gateway wrote the last generated content to the client"),
    "first_wait_s": Agg("min", "float", "engine: queued -> first scheduled, as the engine measured it"),
    # W3C trace context (migration 0011): the gateway's, or without a gateway the engine's.
    "trace_id": Agg("max", "str", "W3C trace id the request ran under (32 hex digits)"),
    "parent_span_id": Agg("max", "str", "the caller's span that sent the request (16 hex digits)"),
    "span_id": Agg("max", "str", "the gateway's span for the request, the parent of the engine's"),
}

SUM_COLUMNS = frozenset(c for c, a in AGGREGATES.items() if a.op == "sum")

Row = dict[str, Any]


def _min(row: Row, col: str, v: Any) -> None:
    if v is None:
        return
    cur = row.get(col)
    if cur is None or v < cur:
        row[col] = v


def _max(row: Row, col: str, v: Any) -> None:
    if v is None:
        return
    cur = row.get(col)
    if cur is None or v > cur:
        row[col] = v


def _add(row: Row, col: str, v: Any) -> None:
    if v:
        row[col] = row.get(col, 0) + v


def _arrived(row: Row, e: Any, source: ev.Source) -> None:
    _max(row, "gateway_source_id", source.id)
    _min(row, "arrived_ts", e.ts)
    _max(row, "trace_id", e.trace_id)
    _max(row, "parent_span_id", e.parent_span_id)
    _max(row, "span_id", e.span_id)


def _admission_enqueued(row: Row, e: Any, source: ev.Source) -> None:
    _max(row, "gateway_source_id", source.id)
    _min(row, "admission_enqueued_ts", e.ts)
    _add(row, "entry_measured_s", e.entry_s)


def _admitted(row: Row, e: Any, source: ev.Source) -> None:
    _max(row, "gateway_source_id", source.id)
    _min(row, "admitted_ts", e.ts)
    _add(row, "admission_wait_s", e.wait_s)


def _first_byte(row: Row, e: Any, source: ev.Source) -> None:
    _min(row, "first_byte_ts", e.ts)


def _first_token_out(row: Row, e: Any, source: ev.Source) -> None:
    _max(row, "gateway_source_id", source.id)
    _min(row, "first_token_out_ts", e.ts)


def _last_token_out(row: Row, e: Any) -> None:
    """The last content's wall-clock time, from the end event's own clock: its ts less the monotonic
    time from that content to the end."""
    if e.last_token_out_s is not None and e.since_arrived_s is not None:
        _max(row, "last_token_out_ts", e.ts - max(0.0, e.since_arrived_s - e.last_token_out_s))


def _completed(row: Row, e: Any, source: ev.Source) -> None:
    _min(row, "completed_ts", e.ts)
    _max(row, "status_code", e.status_code)
    _last_token_out(row, e)


def _client_disconnected(row: Row, e: Any, source: ev.Source) -> None:
    _min(row, "disconnected_ts", e.ts)
    _last_token_out(row, e)


def _stream_cut(row: Row, e: Any, source: ev.Source) -> None:
    _min(row, "stream_cut_ts", e.ts)
    _max(row, "cut_rule", e.rule)


def _queued(row: Row, e: Any, source: ev.Source) -> None:
    _engine(row, source)
    _min(row, "queued_ts", e.ts)
    _min(row, "engine_arrival_ts", e.arrival_ts if e.arrival_ts is not None else e.ts)
    _max(row, "prompt_tokens", e.prompt_tokens)
    _max(row, "max_tokens", e.max_tokens)
    _max(row, "trace_id", e.trace_id)
    _max(row, "parent_span_id", e.parent_span_id)


def _chunk(row: Row, e: Any, source: ev.Source) -> None:
    _engine(row, source)
    _min(row, "first_scheduled_ts", e.ts)
    _add(row, "chunks", 1)
    _add(row, "cached_tokens", e.cached_tokens)
    _add(row, "prefill_computed_tokens", e.tokens - e.recomputed_tokens)
    _add(row, "recomputed_tokens", e.recomputed_tokens)
    _max(row, "kv_blocks_max", e.kv_blocks)
    _add(row, "backend_wait_measured_s", e.wait_s)
    _min(row, "first_wait_s", e.wait_s)


def _tokens(row: Row, e: Any, source: ev.Source) -> None:
    _engine(row, source)
    _min(row, "first_token_ts", e.first_ts if e.first_ts is not None else e.ts)
    _max(row, "last_token_ts", e.ts)
    _max(row, "output_tokens", e.total)
    _max(row, "kv_blocks_max", e.kv_blocks)
    _add(row, "token_events", 1)


def _preempted(row: Row, e: Any, source: ev.Source) -> None:
    _engine(row, source)
    _add(row, "preemptions", 1)


def _resumed(row: Row, e: Any, source: ev.Source) -> None:
    _engine(row, source)
    _add(row, "resumes", 1)
    _add(row, "backend_wait_measured_s", e.wait_s)
    _add(row, "requeue_wait_decode_s" if e.output_tokens else "requeue_wait_prefill_s", e.wait_s)


def _finished(row: Row, e: Any, source: ev.Source) -> None:
    _engine(row, source)
    _min(row, "finished_ts", e.ts)
    _max(row, "finish_reason", e.reason)
    _max(row, "stop_reason", e.stop_reason)
    _max(row, "output_tokens", e.output_tokens)
    _add(row, "backend_wait_measured_s", e.wait_s)
    _add(row, "final_wait_s", e.wait_s)


def _cutoff_applied(row: Row, e: Any, source: ev.Source) -> None:
    _max(row, "cut_rule", e.rule)


def _engine(row: Row, source: ev.Source) -> None:
    _max(row, "engine_source_id", source.id)
    _max(row, "model", source.model)


_FOLDERS: dict[str, Callable[[Row, Any, ev.Source], None]] = {
    "arrived": _arrived,
    "admission_enqueued": _admission_enqueued,
    "admitted": _admitted,
    "first_byte": _first_byte,
    "first_token_out": _first_token_out,
    "completed": _completed,
    "client_disconnected": _client_disconnected,
    "stream_cut": _stream_cut,
    "queued": _queued,
    "chunk": _chunk,
    "tokens": _tokens,
    "preempted": _preempted,
    "resumed": _resumed,
    "finished": _finished,
    "cutoff_applied": _cutoff_applied,
}


_BY_TYPE: dict[type, Callable[[Row, Any, ev.Source], None]] = {
    ev.EVENT_TYPES[kind]: folder for kind, folder in _FOLDERS.items()
}


def fold_step(rows: dict[str, Row], step: ev.Step) -> None:
    """Fold one ``step`` event into the rows of the requests it ran and the ones it left stalled.

    Only counts and sums, so the rows still merge in any order; the step's own row goes to ``steps``.
    """
    end = step.ts + step.duration_s
    d = step.duration_s
    for rid in step.request_ids:
        row = rows.get(rid)
        if row is None:
            row = rows[rid] = {}
        row["step_count"] = row.get("step_count", 0) + 1
        row["active_s"] = row.get("active_s", 0.0) + d
        cur = row.get("last_step_ts")
        if cur is None or end > cur:
            row["last_step_ts"] = end
    if step.token_counts:
        for rid, count, total in zip(step.request_ids, step.token_counts, step.token_totals, strict=True):
            if count:
                _step_tokens(rows[rid], end, end, total)
    _fold_stalled(rows, step)


def _step_tokens(row: Row, first: float, last: float, total: int) -> None:
    """Output tokens a request got from steps (columnar ``token_counts``), produced at the steps' ends:
    the same columns a ``tokens`` event sets (but ``token_events`` and ``events``: no event of its own)."""
    _min(row, "first_token_ts", first)
    _max(row, "last_token_ts", last)
    _max(row, "last_event_ts", last)
    _max(row, "output_tokens", total)


def _fold_stalled(rows: dict[str, Row], step: ev.Step) -> None:
    d = step.duration_s
    blocks = step.stalled_kv_blocks
    for i, rid in enumerate(step.stalled_request_ids):
        row = rows.get(rid)
        if row is None:
            row = rows[rid] = {}
        row["stalled_steps"] = row.get("stalled_steps", 0) + 1
        row["kv_idle_s"] = row.get("kv_idle_s", 0.0) + d
        if i < len(blocks):
            row["kv_idle_block_s"] = row.get("kv_idle_block_s", 0.0) + d * blocks[i]


# Below this many participants (runners plus stalled) in a group's steps, folding them one by one in
# Python is cheaper than building columns.
COLUMNS_FOLD_MIN_PARTICIPANTS = 256


def _blocks_line_up(st: ev.Step) -> bool:
    return not st.stalled_kv_blocks or len(st.stalled_kv_blocks) == len(st.stalled_request_ids)


def fold_steps(rows: dict[str, Row], steps: list[ev.Step]) -> None:
    """Fold many ``step`` events at once; the same rows as ``fold_step`` on each, in any order.

    A step names every request it ran (32 and more per step in a busy engine): folding them one by one
    was a third of the ledger's per-event CPU. Above ``COLUMNS_FOLD_MIN_PARTICIPANTS`` the steps become
    columns (``ledger.columnar.steps_of``) and fold as a columnar message's do (``fold_columns``); a step
    whose block counts do not line up with its stalled requests (the contract refuses it, ``fold_step``
    takes the counts it has) folds one by one.
    """
    n = sum(len(st.request_ids) + len(st.stalled_request_ids) for st in steps)
    columns = [st for st in steps if _blocks_line_up(st)] if n >= COLUMNS_FOLD_MIN_PARTICIPANTS else []
    if columns:
        fold_columns(rows, *steps_of(columns))
    if len(columns) < len(steps):
        for st in steps if not columns else (st for st in steps if not _blocks_line_up(st)):
            fold_step(rows, st)


@dataclass
class StepFold:
    """Steps folded per request, as columns: the requests (``ids``) and, per column the steps set, one
    array aligned with them (``fold_step``'s columns: where a request's steps set nothing, sums are 0,
    or NaN for ``kv_idle_block_s`` when no step said its blocks, and minima and maxima NaN, or -1 for
    ``output_tokens``)."""

    ids: list[str]
    columns: dict[str, np.ndarray]

    def into(self, rows: dict[str, Row]) -> None:
        """Merge into partial rows (a Python loop per request: for few of them, or a JSON batch). A
        request gets the columns ``fold_step`` would give it: those of running if it ran, of sitting
        out if it did, the block-seconds if a step said its blocks."""
        cols = {c: v.tolist() for c, v in self.columns.items()}
        ran, sat = cols.get("step_count"), cols.get("stalled_steps")
        sums = [
            (c, cols[c], ran if c in ("step_count", "active_s") else sat) for c in _STEP_SUMS if c in cols
        ]
        extremes = [
            (c, cols[c], _min if AGGREGATES[c].op == "min" else _max, -1 if c == "output_tokens" else None)
            for c in cols
            if c not in _STEP_SUMS
        ]
        for i, rid in enumerate(self.ids):
            row = rows.get(rid)
            if row is None:
                row = rows[rid] = {}
            for c, v, took_part in sums:
                x = v[i]
                if took_part is not None and took_part[i] and x == x:  # NaN: blocks not said
                    row[c] = row.get(c, 0) + x
            for c, v, merge, unset in extremes:
                x = v[i]
                if x == x and x != unset:  # NaN: a time no step set; -1: no output tokens
                    merge(row, c, x)


# Sums a step fold sets (the rest are minima and maxima), and every column it sets, in table order
# (``request_step_parts``, migration 0010).
_STEP_SUMS = ("step_count", "active_s", "stalled_steps", "kv_idle_s", "kv_idle_block_s")
STEP_FOLD_COLUMNS = tuple(
    c
    for c in AGGREGATES
    if c in _STEP_SUMS
    or c in ("last_step_ts", "first_token_ts", "last_token_ts", "last_event_ts", "output_tokens")
)


def fold_columns(rows: dict[str, Row], steps: Steps, ids: list[str]) -> None:
    """Fold steps sent as columns (``ledger.columnar.Steps``, their request keys indexing ``ids``) into
    ``rows``: the same rows as ``fold_step`` on each step."""
    fold_step_columns([(steps, ids, np.arange(len(ids)))]).into(rows)


@dataclass
class _StepEntries:
    """The entries of a group's columnar messages, gathered message by message for one fold: the
    runners (each request in each step), the token counts and the stalled requests, with their codes
    (the request across messages) and names (an index into the messages' ids, concatenated)."""

    names: list[np.ndarray] = field(default_factory=list)
    run: dict[str, list[np.ndarray]] = field(default_factory=lambda: _lists("codes", "names", "dur", "end"))
    tok: dict[str, list[np.ndarray]] = field(default_factory=lambda: _lists("codes", "end", "total"))
    st: dict[str, list[np.ndarray]] = field(
        default_factory=lambda: _lists("codes", "names", "dur", "block_s", "known")
    )
    base: int = 0

    def add(self, steps: Steps, ids: list[str], codes: np.ndarray) -> None:
        self.names.append(np.asarray(ids, dtype=object))
        lens = steps.lengths
        dur = steps.scalar("duration_s")
        step_of = np.repeat(np.arange(steps.n), lens[0])  # each runner's step
        end = (steps.scalar("ts") + dur)[step_of]
        keys = steps.values["request_keys"]
        _push(self.run, codes=codes[keys], names=keys + self.base, dur=dur[step_of], end=end)
        counts = steps.values["token_counts"]
        if len(counts):
            carried = np.repeat(lens[3] > 0, lens[0])  # the rows of steps that carry token columns
            got = counts > 0
            total = steps.values["token_totals"][got].astype(np.int64)
            _push(self.tok, codes=codes[keys[carried][got]], end=end[carried][got], total=total)
        skeys = steps.values["stalled_keys"]
        if len(skeys):
            sd = dur[np.repeat(np.arange(steps.n), lens[1])]
            known = np.repeat(lens[2] > 0, lens[1])  # rows of steps that said their blocks
            block_s = np.zeros(len(skeys))
            block_s[known] = sd[known] * steps.values["stalled_kv_blocks"]
            _push(self.st, codes=codes[skeys], names=skeys + self.base, dur=sd, block_s=block_s, known=known)
        self.base += len(ids)


def _lists(*names: str) -> dict[str, list[np.ndarray]]:
    return {n: [] for n in names}


def _push(into: dict[str, list[np.ndarray]], **arrays: np.ndarray) -> None:
    for name, a in arrays.items():
        into[name].append(a)


def fold_step_columns(parts: list[tuple[Steps, list[str], np.ndarray]]) -> StepFold:
    """Fold the steps of several columnar messages at once: per message its steps, its ids and an
    integer per id that names the request across the messages (the store's request keys). The same
    rows as ``fold_step`` on every step, grouped with ``np.unique`` and ``np.bincount`` (``ufunc.at`` for
    the minima and maxima): no Python per request or per entry."""
    e = _StepEntries()
    for steps, ids, codes in parts:
        if steps.n and ids:
            e.add(steps, ids, codes)
    if not e.names:
        return StepFold([], {})
    every = np.concatenate(e.run["codes"] + e.st["codes"])
    uniq, first, inverse = np.unique(every, return_index=True, return_inverse=True)
    k = len(uniq)
    name_of = np.concatenate(e.run["names"] + e.st["names"])[first]
    ids_out: list[str] = np.concatenate(e.names)[name_of].tolist()
    n_run = sum(len(c) for c in e.run["codes"])
    run, stalled = inverse[:n_run], inverse[n_run:]
    cols: dict[str, np.ndarray] = {}
    if n_run:
        cols["step_count"] = np.bincount(run, minlength=k)
        cols["active_s"] = np.bincount(run, weights=np.concatenate(e.run["dur"]), minlength=k)
        last = np.full(k, -np.inf)
        np.maximum.at(last, run, np.concatenate(e.run["end"]))
        last[cols["step_count"] == 0] = np.nan
        cols["last_step_ts"] = last
    if e.tok["codes"]:
        _token_columns(cols, np.searchsorted(uniq, np.concatenate(e.tok["codes"])), e.tok, k)
    if len(stalled):
        _stalled_columns(cols, stalled, e.st, k)
    return StepFold(ids_out, cols)


def _token_columns(
    cols: dict[str, np.ndarray], tk: np.ndarray, tok: dict[str, list[np.ndarray]], k: int
) -> None:
    """First and last token times and the output tokens of the ``k`` requests (``tk``: each count's)."""
    te = np.concatenate(tok["end"])
    first_t, last_t = np.full(k, np.inf), np.full(k, -np.inf)
    out_t = np.full(k, -1, np.int64)
    np.minimum.at(first_t, tk, te)
    np.maximum.at(last_t, tk, te)
    np.maximum.at(out_t, tk, np.concatenate(tok["total"]))
    none = out_t < 0
    first_t[none] = last_t[none] = np.nan
    cols["first_token_ts"], cols["last_token_ts"], cols["output_tokens"] = first_t, last_t, out_t
    cols["last_event_ts"] = last_t


def _stalled_columns(
    cols: dict[str, np.ndarray], stalled: np.ndarray, st: dict[str, list[np.ndarray]], k: int
) -> None:
    """Stalled steps, KV idle seconds and block-seconds of the ``k`` requests (``stalled``: each entry's)."""
    cols["stalled_steps"] = np.bincount(stalled, minlength=k)
    cols["kv_idle_s"] = np.bincount(stalled, weights=np.concatenate(st["dur"]), minlength=k)
    known = np.concatenate(st["known"])
    if known.any():
        idle_blocks = np.bincount(stalled[known], weights=np.concatenate(st["block_s"])[known], minlength=k)
        idle_blocks[np.bincount(stalled[known], minlength=k) == 0] = np.nan
        cols["kv_idle_block_s"] = idle_blocks


def fold_tokens(rows: dict[str, Row], source: ev.Source, tokens: list[ev.Tokens]) -> None:
    """Fold ``tokens`` events of one source; the same rows as ``_tokens`` on each, inlined.

    They are most of any stream (a group per request per flush). Grouping them in Arrow first
    measured slower (bench: 5.3 vs 4.4 us per event of prepare and fold): the columns cost more to
    build than these dict updates.
    """
    sid, model = source.id, source.model
    for e in tokens:
        rid, ts, total, kv = e.request_id, e.ts, e.total, e.kv_blocks
        first = ts if e.first_ts is None else e.first_ts
        row = rows.get(rid)
        if row is None:
            row = rows[rid] = {}
        cur = row.get("engine_source_id")  # _engine, inlined
        if cur is None or sid > cur:
            row["engine_source_id"] = sid
        if model is not None:
            cur = row.get("model")
            if cur is None or model > cur:
                row["model"] = model
        cur = row.get("first_token_ts")
        if cur is None or first < cur:
            row["first_token_ts"] = first
        cur = row.get("last_token_ts")
        if cur is None or ts > cur:
            row["last_token_ts"] = ts
        cur = row.get("last_event_ts")
        if cur is None or ts > cur:
            row["last_event_ts"] = ts
        cur = row.get("output_tokens")
        if cur is None or total > cur:
            row["output_tokens"] = total
        cur = row.get("kv_blocks_max")
        if cur is None or kv > cur:
            row["kv_blocks_max"] = kv
        row["token_events"] = row.get("token_events", 0) + 1
        row["events"] = row.get("events", 0) + 1


def fold_into(rows: dict[str, Row], source: ev.Source, events: Iterable[Any]) -> None:
    """Fold request events of one source into ``rows`` (request_id -> partial row), in place.

    ``step`` events fold into the requests they name (see ``fold_steps``), ``tokens`` events by
    request (``fold_tokens``); ``dropped`` markers are skipped.
    """
    tokens_cls, step_cls = ev.Tokens, ev.Step
    steps: list[ev.Step] = []
    tokens: list[ev.Tokens] = []
    for e in events:
        cls = type(e)
        if cls is tokens_cls:
            tokens.append(e)
            continue
        if cls is step_cls:
            steps.append(e)
            continue
        folder = _BY_TYPE.get(cls)
        if folder is None:
            continue
        row = rows.get(e.request_id)
        if row is None:
            row = rows[e.request_id] = {}
        folder(row, e, source)
        row["events"] = row.get("events", 0) + 1
        _max(row, "last_event_ts", e.ts)
    if tokens:
        fold_tokens(rows, source, tokens)
    if steps:
        fold_steps(rows, steps)


def merge(a: Row, b: Row) -> Row:
    """Merge two partial rows (the same merge the storage upsert performs)."""
    out = dict(a)
    for col, v in b.items():
        if v is None:
            continue
        op = AGGREGATES[col].op
        if op == "sum":
            _add(out, col, v)
        elif op == "min":
            _min(out, col, v)
        else:
            _max(out, col, v)
    return out


def fold(source_events: Iterable[tuple[ev.Source, Any]]) -> dict[str, Row]:
    """Fold (source, event) pairs into complete rows; a reference for tests and small jobs."""
    rows: dict[str, Row] = {}
    for source, e in source_events:
        fold_into(rows, source, [e])
    return rows
