"""Which columnar wire for the exporter: Arrow IPC or msgpack with packed arrays, beside today's JSON.

One message is one exporter flush of N engine steps (``--steps-per-message``) with the events between
them. A row is one request in one step (about one output token). Per row, for each candidate:

* exporter encode: from the queue entries the engine thread hands over today (``(layout, values)``
  tuples in the exporter's deque, ``engine_hooks/exporter/queue.py``) to the message's bytes, as the
  worker thread would do it (never the engine thread); today's is ``Encoder.prepare`` itself;
* message bytes;
* ledger decode: bytes to validated columns (numpy arrays, no Python object per row or per request;
  today's JSON: ``decode_batch`` to Structs, then the columns built from them in Python);
* ledger decode + fold: the per-request fold of the steps (step count, tokens added, output tokens,
  active seconds, last step end, first/last token time, KV idle) by a group-by, the fastest of
  ``np.bincount``, a stable sort + ``np.*.reduceat`` and Arrow's ``group_by`` for each format, plus the
  rare events folded as today (``fold_into``); today's JSON: ``decode_batch`` + ``fold_into``.

The candidates:

* ``json``: today's body (``Batch``, msgspec JSON, step columns of schema 2).
* ``arrow-all`` / ``arrow-new``: a msgpack envelope (source, versions, the ids, the events other than
  steps as the contract's own Structs) around one Arrow IPC record batch message (the schema is fixed
  by the wire version, so not sent): one row per step, its scalar columns, and the per-(request, step)
  rows as list<int32> columns (request keys, token counts, token totals, token ids, stalled keys and
  their KV blocks): flattened, those lists are the row table and their offsets the step index.
* ``msgpack-all`` / ``msgpack-new``: the same envelope and the same columns as three little-endian
  blocks in one bin field (int64, float64, int32; each type's columns side by side, so one numpy call
  checks a block), that is Arrow's buffers without the IPC framing.

``-all``: request keys are per message (0..k-1 in order of first use) and every message carries the
ids of all the requests it names; ``-new``: keys are per (source, producer run) and a message carries
only the ids not sent before (both sides keep a book, and forget a request at its ``finished``).

Times are CPU time of this process (``time.process_time``: the machine is shared, and wall time would
count the other work's turns), medians of ``--reps`` runs in which the candidates alternate: read them
as ratios. From the sizes the bench also fits each figure as a fixed cost a message plus a cost a row.
``--imports`` (default on) reports what pyarrow would cost an engine process (import time, RSS, size
installed) and whether vLLM's engine core imports it already.

    python -m bench.wire [--steps-per-message 8,16,64] [--steps 1024] [--running 256] [--seed 0]
                         [--reps 7] [--json PATH] [--no-imports]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import operator
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain, pairwise
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa

from engine_hooks import columnar
from engine_hooks import events as ev
from engine_hooks import fields as hook_fields
from engine_hooks.columnar import (
    COLUMNS,
    F64,
    I32,
    I64,
    ID_LISTS,
    LISTS,
    SCALARS,
    STEP_ORDER,
    Packed,
    PackedSteps,
)
from engine_hooks.exporter.encode import Encoder
from engine_hooks.exporter.logonce import LogOnce
from engine_hooks.exporter.queue import Layout, make_builder
from ledger.columnar import (
    Steps,
    _first,
    _positions,
    decode_columns,
    event_errors,
    id_errors,
    step_errors,
    steps_ok,
)
from ledger.fold import Row, fold_into
from ledger.validation import BadBatch, FieldError, decode_batch

STEP_S = 0.03  # a GPU decode step
BUDGET = 8192  # tokens per step
VOCAB = 128_256  # Llama 3's
ID_PREFIX = "cmpl-"
ID_LEN = 32
PREEMPT_EVERY = 100  # steps
RESUME_AFTER = 30  # steps
CUTOFF_EVERY = 1000  # steps: a loop cut off (cutoff_applied, then finished with reason "cutoff")
STALL_SHARE = 0.03  # steps in which a few decodes sit out holding KV (stalled_request_ids)
WIRE_VERSION = columnar.WIRE_VERSION  # of the columnar envelope
_I64, _F64, _I32 = np.dtype("<i8"), np.dtype("<f8"), np.dtype("<i4")

Entry = tuple[Layout, Any]


# ---------------------------------------------------------------------------------------------------
# Traffic: what the vLLM plugin's engine thread hands the exporter, step by step.


def _layout(kind: type[Any], names: tuple[str, ...], many: bool = False) -> Layout:
    """The layout an emitter of ``kind`` with ``names`` queues its values under (``EventQueue.emitter``)."""
    return Layout(kind, names, make_builder(kind, names), many)


L_QUEUED = _layout(ev.Queued, hook_fields.QUEUED_FIELDS)
L_CHUNKS = _layout(ev.Chunk, hook_fields.CHUNK_FIELDS, many=True)
L_PREEMPTED = _layout(ev.Preempted, hook_fields.PREEMPTED_FIELDS)
L_RESUMED = _layout(ev.Resumed, hook_fields.RESUMED_FIELDS)
L_FINISHED = _layout(ev.Finished, hook_fields.FINISHED_FIELDS)
L_CUTOFF = _layout(ev.CutoffApplied, hook_fields.CUTOFF_APPLIED_FIELDS)
L_STEP = _layout(ev.Step, hook_fields.STEP_FIELDS)


@dataclass
class _Req:
    ext: str
    prompt: int
    output: int
    cached: int
    computed: int = 0
    out: int = 0
    chunks: int = 0
    preemptions: int = 0
    hw: int = 0  # most tokens ever computed (a recompute after a preemption counts up to it)
    since: float = 0.0  # wall time it was queued or preempted


@dataclass
class Traffic:
    """Queue entries per engine step: ``warmup`` steps (encoded before the timed ones, not timed: the
    books of ``-new`` start warm) and the timed ``steps``."""

    source: ev.Source
    seq_start: int
    warmup: list[list[Entry]]
    steps: list[list[Entry]]
    rows: list[int]  # requests that ran in each timed step

    def messages(self, per_message: int) -> tuple[list[list[Entry]], list[list[Entry]], list[int]]:
        """(warmup messages, timed messages, rows of each timed message) of ``per_message`` steps."""

        def cut(steps: list[list[Entry]]) -> list[list[Entry]]:
            return [
                list(chain.from_iterable(steps[i : i + per_message]))
                for i in range(0, len(steps), per_message)
            ]

        rows = [sum(self.rows[i : i + per_message]) for i in range(0, len(self.rows), per_message)]
        return cut(self.warmup), cut(self.steps), rows

    def all_messages(self, per_message: int) -> list[list[Entry]]:
        """Every message of ``per_message`` steps, the warmup's first."""
        warm, timed, _ = self.messages(per_message)
        return warm + timed


def _lognormal(rnd: random.Random, median: float, sigma: float, cap: int) -> int:
    return max(1, min(cap, int(math.exp(rnd.gauss(math.log(median), sigma)))))


def generate(
    *,
    steps: int,
    warmup: int = 64,
    running: int = 256,
    seed: int = 0,
    multi_token_share: float = 0.0,
    token_ids: bool = True,
    preempt_every: int = PREEMPT_EVERY,
    cutoff_every: int = CUTOFF_EVERY,
    stall_share: float = STALL_SHARE,
    budget: int = BUDGET,
) -> Traffic:
    """A GPU-shaped engine: ``running`` requests decoding one token a step (``multi_token_share`` of the
    decodes get 2-3, as with speculative decoding), prompts and outputs log-normal (median 800 and 250
    tokens), 30 % prefix hits, a new request queued and prefilled (in chunks from the step's budget)
    for each one finished, a preemption every ``preempt_every`` steps (resumed 30 steps later,
    recomputing), a cutoff every ``cutoff_every``, and in ``stall_share`` of the steps a few decodes
    sitting out with their KV blocks.
    Deterministic for a ``seed``; the entries are those of the plugin (``engine_hooks.fields`` orders),
    in its emit order within a step (queued, preempted, resumed, chunks, cutoff, finished, step)."""
    rnd = random.Random(seed)
    weights = [1.0 / (rank + 10) for rank in range(VOCAB)]
    vocab = range(VOCAB)
    draws: list[int] = []
    t0 = 1.75e9

    def new_req(since: float) -> _Req:
        prompt = _lognormal(rnd, 800, 1.0, 8192)
        cached = (prompt // 2) // 16 * 16 if rnd.random() < 0.3 else 0
        ext = ID_PREFIX + format(
            rnd.getrandbits(4 * (ID_LEN - len(ID_PREFIX))), f"0{ID_LEN - len(ID_PREFIX)}x"
        )
        return _Req(ext, prompt, _lognormal(rnd, 250, 0.9, 2048), cached, computed=cached, since=since)

    live: list[_Req] = []  # running, in schedule order
    for _ in range(running):  # the engine is mid-flight: every request decoding
        r = new_req(t0)
        r.out = rnd.randrange(1, r.output + 1)
        r.computed = r.hw = r.prompt + r.out - 1
        r.chunks = 1
        live.append(r)
    waiting: list[_Req] = []
    preempted: list[tuple[int, _Req]] = []  # (step it resumes at, request)
    out_warm: list[list[Entry]] = []
    out_steps: list[list[Entry]] = []
    rows: list[int] = []
    for k in range(warmup + steps):
        ts = t0 + k * STEP_S + rnd.uniform(0, 1e-3)
        dur = STEP_S * rnd.uniform(0.8, 0.95)
        end = ts + dur
        entries: list[Entry] = []
        while len(live) + len(waiting) + len(preempted) < running:
            r = new_req(ts)
            waiting.append(r)
            entries.append((L_QUEUED, (ts, r.ext, r.prompt, 2048, ts - rnd.uniform(0.001, 0.005), 0)))
        if k % preempt_every == preempt_every // 3 and live:
            r = live.pop()
            entries.append((L_PREEMPTED, (ts, r.ext, r.computed // 16 + 1, r.computed)))
            r.preemptions += 1
            r.since = ts
            r.computed = 0
            preempted.append((k + RESUME_AFTER, r))
        while preempted and preempted[0][0] <= k:
            waiting.insert(0, preempted.pop(0)[1])  # vLLM puts a preempted request back in front
        stalled: set[int] = set()
        if rnd.random() < stall_share:
            stalled = {id(r) for r in rnd.sample(live, min(len(live), rnd.randint(1, 6)))}
        left = budget
        chunk_rows: list[tuple[Any, ...]] = []
        got: list[tuple[str, int, int]] = []  # (id, new tokens, total): requests with output this step
        none: list[tuple[str, int, int]] = []  # requests that ran and got none (a partial prefill)
        stalled_ids: list[str] = []
        stalled_blocks: list[int] = []
        prefilling: list[_Req] = []
        decode = 0
        for r in live:  # decodes first, one token each (2-3 with speculative decoding)
            if r.computed < r.prompt + max(r.out - 1, 0):
                prefilling.append(r)
            elif id(r) in stalled:
                stalled_ids.append(r.ext)
                stalled_blocks.append(r.computed // 16 + 1)
            else:
                n = 2 + (rnd.random() < 0.5) if rnd.random() < multi_token_share else 1
                n = min(n, r.output - r.out)
                left -= n
                decode += n
                r.computed += n
                r.hw = max(r.hw, r.computed)
                got.append((r.ext, n, r.out + n))
                r.out += n
        n_decode = len(got)
        prefill = n_prefill = depth = max_depth = 0
        for r in prefilling + waiting:  # then chunks, from what the decodes left of the budget
            held = r.prompt + max(r.out - 1, 0)
            n = min(held - r.computed, left)
            if n <= 0:
                break
            if r in waiting:
                waiting.remove(r)
                live.append(r)
                if r.preemptions:
                    entries.append((L_RESUMED, (ts, r.ext, ts - r.since, 0, r.out)))
            first = r.chunks == 0
            before = r.computed
            chunk_rows.append(
                (
                    ts,
                    r.ext,
                    k,
                    n,
                    before,
                    (min(before + n, r.hw) - before) if r.hw > before else 0,
                    r.cached if first else 0,
                    (before + n) // 16 + 1,
                    r.preemptions,
                    ts - r.since if first else None,
                )
            )
            r.chunks += 1
            r.computed += n
            r.hw = max(r.hw, r.computed)
            left -= n
            prefill += n
            n_prefill += 1
            depth += n * before
            max_depth = max(max_depth, before)
            if r.computed >= held:  # the last chunk samples a token
                got.append((r.ext, 1, r.out + 1))
                r.out += 1
            else:
                none.append((r.ext, 0, r.out))
        ids: list[int] = []
        for _, n, _ in got:
            for _ in range(n):
                if not draws:
                    draws = rnd.choices(vocab, weights, k=65_536)
                ids.append(draws.pop())
        if chunk_rows:
            entries.append((L_CHUNKS, chunk_rows))
        cut = live[len(live) // 2] if k % cutoff_every == cutoff_every // 2 and live else None
        if cut is not None:
            entries.append((L_CUTOFF, (end, cut.ext, f"cmd-{k}", "abort", "loop")))
        n_running = len(live)
        finished = [r for r in live if r is cut or r.out >= r.output]
        for r in finished:
            reason = "cutoff" if r is cut else ("length" if r.out >= 2048 else "stop")
            stop = "chunkledger:loop" if r is cut else None
            entries.append((L_FINISHED, (end, r.ext, reason, r.out, stop, None)))
            live.remove(r)
        ran = got + none
        entries.append(
            (
                L_STEP,
                (
                    ts,
                    k,
                    dur,
                    prefill,
                    decode,
                    n_prefill,
                    n_decode,
                    n_running,
                    len(waiting) + len(preempted),
                    round(rnd.uniform(0.6, 0.95), 4),
                    [x[0] for x in ran],
                    depth,
                    max_depth,
                    stalled_ids,
                    stalled_blocks,
                    [x[1] for x in ran],
                    [x[2] for x in ran],
                    ids if token_ids else [],
                ),
            )
        )
        if k < warmup:
            out_warm.append(entries)
        else:
            out_steps.append(entries)
            rows.append(len(ran))
    source = ev.Source(id="engine-0", kind="engine", model="llama-3-70b")
    return Traffic(source, 1_750_000_000_000_000, out_warm, out_steps, rows)


def small_traffic(seed: int) -> Traffic:
    """A small run with every kind in it (arrivals, chunks, finishes, a preemption and its resume,
    cutoffs, stalled steps, speculative decodes of 2-3 tokens): the tests' traffic."""
    return generate(
        steps=120,
        warmup=8,
        running=10,
        seed=seed,
        multi_token_share=0.2,
        preempt_every=40,
        cutoff_every=30,
        stall_share=0.2,
        budget=600,
    )


def reference_events(entries: Iterable[Entry], seq: int) -> tuple[list[ev.Event], int]:
    """The events the entries stand for, numbered from ``seq`` (what today's worker builds)."""
    out: list[ev.Event] = []
    for layout, values in entries:
        for row in values if layout.many else (values,):
            out.append(layout.build(seq, row))
            seq += 1
    return out, seq


# ---------------------------------------------------------------------------------------------------
# The step columns, shared by the columnar candidates.

# The step columns and their packing are the product's (engine_hooks/columnar.py, the encoder;
# ledger/columnar.py, the checks): the msgpack-all candidate is that codec, and the others share its
# columns. Here: the request keys of -all and -new.


class MessageKeys:
    """``-all``: keys per message, 0..k-1 in order of first use; the message carries every id."""

    name = "all"
    epoch = 0

    def assign(self, runners: list[str], stalled: list[str]) -> tuple[list[int], list[int], list[str], int]:
        return (*columnar.assign_keys(runners, stalled), 0)

    def sent(self, events: list[ev.Event]) -> None:
        pass


class SourceKeys:
    """``-new``: keys per (source, producer run: ``epoch``), the ids sent once; a request is forgotten
    once its ``finished`` is encoded. (With several batches in flight a real exporter would re-send an
    id until the batch that first carried it is acknowledged: here each message is acknowledged before
    the next is encoded.)"""

    name = "new"

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.book: dict[str, int] = {}
        self.next = 0

    def assign(self, runners: list[str], stalled: list[str]) -> tuple[list[int], list[int], list[str], int]:
        book = self.book
        new = [r for r in dict.fromkeys(chain(runners, stalled)) if r not in book]
        base = self.next
        book.update(zip(new, range(base, base + len(new)), strict=True))
        self.next = base + len(new)
        get = book.__getitem__
        return list(map(get, runners)), list(map(get, stalled)), new, base

    def sent(self, events: list[ev.Event]) -> None:
        finished = ev.Finished
        for e in events:
            if type(e) is finished:
                self.book.pop(e.request_id, None)


# ---------------------------------------------------------------------------------------------------
# The envelopes (msgpack): the same for both columnar candidates but for how the step columns travel.


class _Envelope(msgspec.Struct, kw_only=True):
    source: ev.Source
    wire_version: int = WIRE_VERSION
    schema_version: int = ev.SCHEMA_VERSION
    key_epoch: int = 0  # -new: the producer run the keys belong to (its first seq); -all: 0
    key_base: int = 0  # the key of ids[0] (-all: 0)
    ids: memoryview  # UTF-8 request ids, packed; the i-th is key key_base + i
    id_offsets: memoryview  # int32, len(ids) + 1
    events: list[ev.Event] = []  # the other events (queued, chunk, finished, ...): the contract's Structs


class ArrowMessage(_Envelope, kw_only=True):
    steps: memoryview  # an Arrow IPC record batch message, one row per step, of ARROW_SCHEMA (fixed by
    # the wire version, so not sent: an IPC stream would add the schema message to every body)


class PackedMessage(_Envelope, kw_only=True):
    steps: PackedSteps


_envelope_encoder = msgspec.msgpack.Encoder()
_arrow_decoder = msgspec.msgpack.Decoder(ArrowMessage)
_packed_decoder = msgspec.msgpack.Decoder(PackedMessage)
_events_validator = msgspec.msgpack.Decoder(list[ev.Event])

_ARROW_TYPES = {
    **dict.fromkeys(I64, pa.int64()),
    **dict.fromkeys(F64, pa.float64()),
    **dict.fromkeys(I32, pa.int32()),
}
_LIST_I32 = pa.list_(pa.int32())
ARROW_SCHEMA = pa.schema(
    [(n, _ARROW_TYPES[n]) for n in (*I64, *F64, *I32)] + [(c, _LIST_I32) for c in COLUMNS]
)


def _arrow_batch(p: Packed) -> pa.RecordBatch:
    """The record batch over the packed blocks (zero-copy slices)."""
    n = p.n
    i64, f64, i32 = pa.py_buffer(p.i64), pa.py_buffer(p.f64), pa.py_buffer(p.i32)
    arrays = [pa.Array.from_buffers(pa.int64(), n, [None, i64.slice(8 * n * k, 8 * n)]) for k in range(3)]
    arrays += [pa.Array.from_buffers(pa.float64(), n, [None, f64.slice(8 * n * k, 8 * n)]) for k in range(3)]
    arrays += [pa.Array.from_buffers(pa.int32(), n, [None, i32.slice(4 * n * k, 4 * n)]) for k in range(7)]
    at = 4 * (7 * n + 6 * (n + 1))
    for k, count in enumerate(p.counts):
        values = pa.Array.from_buffers(pa.int32(), count, [None, i32.slice(at, 4 * count)])
        offsets = i32.slice(4 * (7 * n + k * (n + 1)), 4 * (n + 1))
        arrays.append(pa.Array.from_buffers(_LIST_I32, n, [None, offsets], children=[values]))
        at += 4 * count
    return pa.RecordBatch.from_arrays(arrays, schema=ARROW_SCHEMA)


class ColumnarEncoder:
    """The worker's encoder for a columnar candidate: numbers the entries as today, flattens the steps,
    assigns request keys, packs and checks the columns, and encodes the envelope around them.
    msgpack-all is the product's encoder (``engine_hooks.columnar.ColumnarEncoder``) and this check."""

    def __init__(
        self,
        source: ev.Source,
        seq_start: int,
        keys: MessageKeys | SourceKeys,
        arrow: bool,
        check: bool = True,
    ):
        self.source, self.next_seq, self.keys, self.arrow = source, seq_start, keys, arrow
        self.check = check  # off: send what it is given (to test the ledger's checks)
        self.product = (
            columnar.ColumnarEncoder(source, seq_start)
            if isinstance(keys, MessageKeys) and not arrow
            else None
        )

    def _check(self, steps: Steps, events: list[ev.Event]) -> None:
        """What the worker checks before it sends (today it decodes its own JSON against the contract)."""
        if not steps_ok(steps):
            raise ValueError("a step breaks the contract")  # the worker would drop it, as today
        if events:
            _events_validator.decode(_envelope_encoder.encode(events))

    def __call__(self, entries: list[Entry]) -> bytes:
        if self.product is not None:
            msg = self.product.message(entries)
            if self.check:
                self._check(Steps.from_wire(msg.steps, copy=False), msg.events)
            return columnar.encoder.encode(msg)
        flat, self.next_seq = columnar.flatten(entries, self.next_seq)
        cols = flat.cols
        runners, stalled = (list(chain.from_iterable(cols[n])) for n in columnar.ID_LISTS)
        rkeys, skeys, ids, base = self.keys.assign(runners, stalled)
        packed = columnar.pack_steps(
            flat.seq, cols, dict(zip(columnar.ID_LISTS, (rkeys, skeys), strict=True))
        )
        if self.check:
            self._check(Steps.view(packed), flat.events)
        data, id_offsets = columnar.pack_ids(ids)
        head: dict[str, Any] = {
            "source": self.source,
            "key_epoch": self.keys.epoch,
            "key_base": base,
            "ids": memoryview(data),
            "id_offsets": memoryview(id_offsets),
            "events": flat.events,
        }
        if self.arrow:  # the record batch's IPC message alone: the schema is the wire version's
            ipc = memoryview(_arrow_batch(packed).serialize())
            body = _envelope_encoder.encode(ArrowMessage(**head, steps=ipc))
        else:
            body = _envelope_encoder.encode(PackedMessage(**head, steps=packed.wire()))
        self.keys.sent(flat.events)
        return body


# ---------------------------------------------------------------------------------------------------
# The ledger's side: bytes -> validated columns.


@dataclass
class Columns:
    """A message: its steps as columns, the ids of its keys (``names``), its other events as the
    contract's Structs."""

    source: ev.Source
    steps: Steps
    events: list[ev.Event]
    names: Callable[[np.ndarray], pa.Array]  # keys -> their request ids (an Arrow string array)
    ids: pa.Array  # the ids the message carries (-all: of keys 0..k-1)

    @property
    def rows(self) -> int:
        return len(self.steps.values["request_keys"])


class MessageBook:
    """-all on the ledger: nothing kept between messages; a message's keys index its own ids."""

    def take(self, msg: _Envelope, ids: pa.Array, s: Steps) -> tuple[list[FieldError], Any]:
        n = len(ids)
        errors = []
        for name in ("request_keys", "stalled_keys"):
            k = s.values[name]
            if len(k) and k.max() >= n:  # not negative: steps_ok
                j = _first(k >= n)
                errors.append(
                    FieldError(None, f"steps.{name}[{j}]", f"key {int(k[j])} is not one of {n} ids")
                )
        return errors, ids.take

    def forget(self, events: list[ev.Event]) -> None:
        pass


class SourceBook:
    """-new on the ledger: per (source, producer run) the ids of the keys it sent, forgotten once a
    message with a request's ``finished`` is folded. (In memory here; a ledger would keep it with the
    group's commit.)"""

    def __init__(self) -> None:
        self.epoch: int | None = None
        self.by_key: dict[int, str] = {}
        self.by_id: dict[str, int] = {}
        self.live = np.zeros(1024, bool)
        self.next = 0
        self.forgotten: list[int] = []

    def take(self, msg: _Envelope, ids: pa.Array, s: Steps) -> tuple[list[FieldError], Any]:
        for key in self.forgotten:  # the previous message's finished requests, now folded
            del self.by_key[key]
            self.live[key] = False
        self.forgotten = []
        if msg.key_epoch != self.epoch:
            self.__init__()  # type: ignore[misc]
            self.epoch = msg.key_epoch
        if msg.key_base != self.next:
            return [FieldError(None, "key_base", f"{msg.key_base}: the next new key is {self.next}")], None
        new = ids.to_pylist()
        top = self.next + len(new)
        if top > len(self.live):
            self.live = np.concatenate(
                (self.live, np.zeros(max(top, 2 * len(self.live)) - len(self.live), bool))
            )
        errors = []
        for name in ("request_keys", "stalled_keys"):
            k = s.values[name]
            if len(k) and (k.max() >= top or not self.live[k[k < self.next]].all()):
                ok = k < top
                ok[ok] &= (k[ok] >= self.next) | self.live[k[ok]]
                j = _first(~ok)
                errors.append(FieldError(None, f"steps.{name}[{j}]", f"key {int(k[j])} is not known"))
        if errors:
            return errors, None
        by_key, by_id = self.by_key, self.by_id
        by_key.update(zip(range(self.next, top), new, strict=True))
        by_id.update(zip(new, range(self.next, top), strict=True))
        self.live[self.next : top] = True
        self.next = top

        def names(keys: np.ndarray) -> pa.Array:
            return pa.array([by_key[k] for k in keys.tolist()], pa.string())

        return [], names

    def forget(self, events: list[ev.Event]) -> None:
        finished = ev.Finished
        for e in events:
            if type(e) is finished:
                key = self.by_id.pop(e.request_id, None)
                if key is not None:
                    self.forgotten.append(key)


class ColumnarDecoder:
    """The ledger's decoder for a columnar candidate: envelope, step columns, ids, checks.
    msgpack-all is the product's decoder (``ledger.columnar.decode_columns``)."""

    def __init__(self, arrow: bool, book: MessageBook | SourceBook):
        self.arrow, self.book = arrow, book
        self.product = not arrow and isinstance(book, MessageBook)

    def __call__(self, body: bytes) -> Columns:
        if self.product:
            c = decode_columns(body, max_events=1 << 30)
            ids = pa.Array.from_buffers(
                pa.string(),
                len(c.id_offsets) - 1,
                [None, pa.py_buffer(c.id_offsets), pa.py_buffer(c.id_data)],
            )
            return Columns(c.source, c.steps, c.events, ids.take, ids)
        try:
            msg: _Envelope = (_arrow_decoder if self.arrow else _packed_decoder).decode(body)
        except msgspec.ValidationError as exc:
            raise BadBatch([FieldError(None, "body", str(exc))]) from None
        except msgspec.DecodeError as exc:
            raise BadBatch([FieldError(None, "body", f"malformed msgpack: {exc}")]) from None
        if msg.wire_version != WIRE_VERSION or msg.schema_version > ev.SCHEMA_VERSION:
            raise BadBatch([FieldError(None, "wire_version", f"{msg.wire_version}/{msg.schema_version}")])
        try:
            s = self._arrow(msg.steps) if self.arrow else Steps.from_wire(msg.steps)  # type: ignore[attr-defined]
            id_offsets = np.frombuffer(bytes(msg.id_offsets), _I32)
        except (ValueError, TypeError, pa.ArrowException) as exc:
            raise BadBatch([FieldError(None, "steps", f"malformed columns: {exc}")]) from None
        data = bytes(msg.ids)
        layout, bad = id_errors(data, id_offsets)
        errors = layout + [FieldError(None, f"ids[{j}]", reason) for j, reason in bad]
        if errors:
            raise BadBatch(errors)
        ids = pa.Array.from_buffers(
            pa.string(), len(id_offsets) - 1, [None, pa.py_buffer(id_offsets), pa.py_buffer(data)]
        )
        step_at, event_at = _positions(s.seq, [e.seq for e in msg.events])
        if not steps_ok(s):
            errors = step_errors(s, step_at) or [FieldError(None, "steps", "the columns break the contract")]
        errors += event_errors(msg.source, msg.events, event_at)
        if not errors:
            more, names = self.book.take(msg, ids, s)
            errors += more
        if errors:
            raise BadBatch(errors[:20])
        self.book.forget(msg.events)
        return Columns(msg.source, s, msg.events, names, ids)

    @staticmethod
    def _arrow(steps: memoryview) -> Steps:
        batch = pa.ipc.read_record_batch(pa.py_buffer(bytes(steps)), ARROW_SCHEMA)  # bytes: aligned
        batch.validate()
        cols = batch.columns
        n = batch.num_rows
        i32 = np.stack([c.to_numpy() for c in cols[6:13]]) if n else np.zeros((7, 0), _I32)
        lists = cols[13:]
        values = {name: col.values.to_numpy() for name, col in zip(COLUMNS, lists, strict=True)}
        return Steps(
            n,
            np.stack([c.to_numpy() for c in cols[:3]]) if n else np.zeros((3, 0), _I64),
            np.stack([c.to_numpy() for c in cols[3:6]]) if n else np.zeros((3, 0), _F64),
            i32,
            np.stack([c.offsets.to_numpy() for c in lists]),
            values,
            [i32, *values.values()],
        )


def columns_from_batch(batch: ev.Batch) -> Columns:
    """Today's Structs to the same columns (Python per row): what a JSON body costs to get there."""
    steps = [e for e in batch.events if type(e) is ev.Step]
    events = [e for e in batch.events if type(e) is not ev.Step]
    get = operator.attrgetter(*STEP_ORDER)
    cols: list[Sequence[Any]] = list(zip(*map(get, steps), strict=True)) if steps else [()] * len(STEP_ORDER)
    by_name = dict(zip(STEP_ORDER, cols, strict=True))
    runners, stalled = (list(chain.from_iterable(by_name[n])) for n in ID_LISTS)
    rkeys, skeys, ids, _ = MessageKeys().assign(runners, stalled)
    packed = columnar.pack_steps(
        [e.seq for e in steps], by_name, dict(zip(ID_LISTS, (rkeys, skeys), strict=True))
    )
    names = pa.array(ids, pa.string())
    return Columns(batch.source, Steps.view(packed), events, names.take, names)


def canonical(events: list[ev.Event]) -> tuple[list[dict[str, Any]], list[ev.Event]]:
    """A message's content to compare exactly: each step's fields (its lists as lists, ids as ids), in
    order, and the other events."""
    steps = [msgspec.structs.asdict(e) for e in events if type(e) is ev.Step]
    return steps, [e for e in events if type(e) is not ev.Step]


def canonical_columns(c: Columns) -> tuple[list[dict[str, Any]], list[ev.Event]]:
    """The same from decoded columns: every row's key resolved to its id through the message's (or the
    book's) ids, every list cut at its offsets."""
    s = c.steps
    cols: dict[str, list[Any]] = {"seq": s.seq.tolist(), **{n: s.scalar(n).tolist() for n in SCALARS}}
    for name, column in zip(LISTS, COLUMNS, strict=True):
        values = s.values[column]
        flat = (
            c.names(values).to_pylist() if name in ("request_ids", "stalled_request_ids") else values.tolist()
        )
        off = s.offsets(column).tolist()
        cols[name] = [flat[a:b] for a, b in pairwise(off)]
    names = ["seq", *(f.name for f in msgspec.structs.fields(ev.Step) if f.name != "seq")]
    steps = [dict(zip(names, (cols[n][i] for n in names), strict=True)) for i in range(s.n)]
    return steps, list(c.events)


# ---------------------------------------------------------------------------------------------------
# The fold: per request, what ``fold_steps`` folds (and the tokens added), as array operations.


@dataclass
class Folded:
    """Per request of the message (``ids``, an Arrow string array): its steps' aggregates; and the
    partial rows of its other events, folded as today."""

    ids: pa.Array
    step_count: np.ndarray
    tokens: np.ndarray  # output tokens added
    output_tokens: np.ndarray  # the largest total among its steps with tokens (-1: none)
    active_s: np.ndarray
    last_step_ts: np.ndarray
    first_token_ts: np.ndarray  # inf: no token
    last_token_ts: np.ndarray
    stalled_steps: np.ndarray
    kv_idle_s: np.ndarray
    kv_idle_block_s: np.ndarray
    block_known: np.ndarray  # some stalled step of it said its blocks
    rows: dict[str, Row]

    def as_rows(self) -> dict[str, Row]:
        """The partial rows ``fold_steps`` makes (for the tests), merged with the other events' rows."""
        from ledger.fold import merge

        out: dict[str, Row] = {}
        for i, rid in enumerate(self.ids.to_pylist()):
            row: Row = {}
            if self.step_count[i]:
                row.update(step_count=int(self.step_count[i]), active_s=float(self.active_s[i]))
                row["last_step_ts"] = float(self.last_step_ts[i])
            if self.output_tokens[i] >= 0:
                row.update(
                    first_token_ts=float(self.first_token_ts[i]), output_tokens=int(self.output_tokens[i])
                )
                row["last_token_ts"] = row["last_event_ts"] = float(self.last_token_ts[i])
            if self.stalled_steps[i]:
                row.update(stalled_steps=int(self.stalled_steps[i]), kv_idle_s=float(self.kv_idle_s[i]))
                if self.block_known[i]:
                    row["kv_idle_block_s"] = float(self.kv_idle_block_s[i])
            out[rid] = row
        for rid, row in self.rows.items():
            out[rid] = merge(out[rid], row) if rid in out else row
        return out


def _fold_bincount(
    idx: np.ndarray, k: int, d: np.ndarray, e: np.ndarray, cnt: np.ndarray, tot: np.ndarray
) -> list[np.ndarray]:
    step_count = np.bincount(idx, minlength=k)
    active = np.bincount(idx, weights=d, minlength=k)
    tokens = np.bincount(idx, weights=cnt, minlength=k).astype(np.int64)
    last_step = np.full(k, -np.inf)
    np.maximum.at(last_step, idx, e)
    got = cnt > 0
    gi, ge = idx[got], e[got]
    first_tok = np.full(k, np.inf)
    np.minimum.at(first_tok, gi, ge)
    last_tok = np.full(k, -np.inf)
    np.maximum.at(last_tok, gi, ge)
    out_tok = np.full(k, -1, tot.dtype)  # the same dtype: ufunc.at is 15x slower with a cast
    np.maximum.at(out_tok, gi, tot[got])
    return [step_count, tokens, out_tok, active, last_step, first_tok, last_tok]


def _fold_sort(
    idx: np.ndarray, k: int, d: np.ndarray, e: np.ndarray, cnt: np.ndarray, tot: np.ndarray
) -> list[np.ndarray]:
    order = np.argsort(idx, kind="stable")
    s = idx[order]
    n = len(s)
    starts = np.flatnonzero(np.concatenate(([True], s[1:] != s[:-1]))) if n else np.zeros(0, np.intp)
    u = s[starts]
    step_count = np.zeros(k, np.int64)
    tokens = np.zeros(k, np.int64)
    out_tok = np.full(k, -1, np.int64)
    active = np.zeros(k)
    last_step = np.full(k, -np.inf)
    first_tok = np.full(k, np.inf)
    last_tok = np.full(k, -np.inf)
    if n:
        got = (cnt > 0)[order]
        eo = e[order]
        step_count[u] = np.diff(np.append(starts, n))
        tokens[u] = np.add.reduceat(cnt[order], starts)
        out_tok[u] = np.maximum.reduceat(np.where(got, tot[order], -1), starts)
        active[u] = np.add.reduceat(d[order], starts)
        last_step[u] = np.maximum.reduceat(eo, starts)
        first_tok[u] = np.minimum.reduceat(np.where(got, eo, np.inf), starts)
        last_tok[u] = np.maximum.reduceat(np.where(got, eo, -np.inf), starts)
    return [step_count, tokens, out_tok, active, last_step, first_tok, last_tok]


_ARROW_AGGS = [
    ("d", "count"),
    ("c", "sum"),
    ("tt", "max"),
    ("d", "sum"),
    ("e", "max"),
    ("te", "min"),
    ("te", "max"),
]


def _fold_arrow(
    idx: np.ndarray, k: int, d: np.ndarray, e: np.ndarray, cnt: np.ndarray, tot: np.ndarray
) -> list[np.ndarray]:
    none = cnt <= 0
    table = pa.table(
        {"k": idx, "d": d, "e": e, "c": cnt, "te": pa.array(e, mask=none), "tt": pa.array(tot, mask=none)}
    )
    g = table.group_by("k", use_threads=False).aggregate(_ARROW_AGGS)
    u = g["k"].to_numpy()
    fills: list[tuple[Any, Any]] = [(0, np.int64), (0, np.int64), (-1, np.int64), (0.0, float)]
    fills += [(-np.inf, float), (np.inf, float), (-np.inf, float)]
    out = []
    for (col, op), (fill, dtype) in zip(_ARROW_AGGS, fills, strict=True):
        a = np.full(k, fill, dtype)
        a[u] = (
            g[f"{col}_{op}"].to_numpy(zero_copy_only=False)
            if op in ("count", "sum")
            else (g[f"{col}_{op}"].fill_null(fill).to_numpy())
        )
        out.append(a)
    return out


FOLDS: dict[str, Callable[..., list[np.ndarray]]] = {
    "bincount": _fold_bincount,
    "sort+reduceat": _fold_sort,
    "arrow group_by": _fold_arrow,
}


def fold_columns(c: Columns, method: str) -> Folded:
    """Group the message's rows by request key with ``method``; stalled rows (a few a message) by
    ``np.bincount``; the other events by ``fold_into`` as today."""
    st = c.steps
    n = st.n
    lens = np.diff(st.offsets2d, axis=1)
    keys = st.values["request_keys"].astype(np.intp)
    step_of = np.repeat(np.arange(n), lens[0])
    dur = st.scalar("duration_s")
    end = st.scalar("ts") + dur
    d, e = dur[step_of], end[step_of]
    cnt, tot = st.values["token_counts"], st.values["token_totals"]
    if len(cnt) != len(keys):  # some steps sent no token columns: their rows got none
        with_tokens = np.repeat(lens[3] > 0, lens[0])
        cnt_all, tot_all = np.zeros(len(keys), _I32), np.zeros(len(keys), _I32)
        cnt_all[with_tokens], tot_all[with_tokens] = cnt, tot
        cnt, tot = cnt_all, tot_all
    skeys = st.values["stalled_keys"].astype(np.intp)
    lo = min(keys.min(initial=2**31), skeys.min(initial=2**31))
    hi = max(keys.max(initial=-1), skeys.max(initial=-1))
    lo = 0 if hi < 0 else lo
    k = hi - lo + 1
    aggs = FOLDS[method](keys - lo, k, d, e, cnt, tot)
    sidx = skeys - lo
    sd = dur[np.repeat(np.arange(n), lens[1])]
    stalled_steps = np.bincount(sidx, minlength=k)
    kv_idle = np.bincount(sidx, weights=sd, minlength=k)
    known = np.repeat(lens[2] > 0, lens[1])
    blocks = st.values["stalled_kv_blocks"]
    kv_block = np.bincount(sidx[known], weights=sd[known] * blocks, minlength=k)
    block_known = np.bincount(sidx[known], minlength=k) > 0
    present = np.flatnonzero((aggs[0] > 0) | (stalled_steps > 0))
    rows: dict[str, Row] = {}
    if c.events:
        fold_into(rows, c.source, c.events)
    whole = len(present) == k  # every key in range (always with per-message keys): no gather
    cols = [*aggs, stalled_steps, kv_idle, kv_block, block_known]
    if not whole:
        cols = [a[present] for a in cols]
    step_count, tokens, out_tok, active, last_step, first_tok, last_tok, *idle = cols
    return Folded(
        c.names(present + lo) if lo or not whole else c.ids,
        step_count,
        tokens,
        out_tok,
        active,
        last_step,
        first_tok,
        last_tok,
        idle[0],
        idle[1],
        idle[2],
        idle[3],
        rows,
    )


# ---------------------------------------------------------------------------------------------------
# The candidates.


@dataclass
class Candidate:
    name: str
    new_encoder: Callable[[ev.Source, int], Callable[[list[Entry]], bytes]]
    new_decoder: Callable[[], Callable[[bytes], Any]]  # bytes -> Columns
    folds: dict[str, Callable[[Any], Any]]  # name -> (decoded -> folded)
    content_type: str


def _json_encoder(source: ev.Source, seq: int) -> Callable[[list[Entry]], bytes]:
    def drop(reason: str, n: int) -> None:
        raise ValueError(f"the exporter dropped {n} events ({reason})")

    enc = Encoder(source, 1 << 30, seq, LogOnce(), drop)

    def encode(entries: list[Entry]) -> bytes:
        (prepared,) = enc.prepare(entries)
        return prepared.body

    return encode


def _json_decoder() -> Callable[[bytes], Columns]:
    return lambda body: columns_from_batch(decode_batch(body, max_events=1 << 30))


def _json_today(body: bytes) -> dict[str, Row]:
    batch = decode_batch(body, max_events=1 << 30)
    rows: dict[str, Row] = {}
    fold_into(rows, batch.source, batch.events)
    return rows


def _columnar(name: str, arrow: bool, per_source: bool) -> Candidate:
    def new_encoder(source: ev.Source, seq: int) -> Callable[[list[Entry]], bytes]:
        return ColumnarEncoder(source, seq, SourceKeys(seq) if per_source else MessageKeys(), arrow)

    def new_decoder() -> Callable[[bytes], Columns]:
        return ColumnarDecoder(arrow, SourceBook() if per_source else MessageBook())

    def fold_by(method: str) -> Callable[[Any], Any]:
        return lambda c: fold_columns(c, method)

    folds = {m: fold_by(m) for m in FOLDS}
    kind = "arrow" if arrow else "msgpack"
    return Candidate(name, new_encoder, new_decoder, folds, f"application/vnd.chunkledger.columnar.{kind}")


def candidates() -> list[Candidate]:
    return [
        Candidate(
            "json",
            _json_encoder,
            _json_decoder,
            {"fold_into (today)": lambda body: _json_today(body)},
            "application/json",
        ),
        _columnar("arrow-all", arrow=True, per_source=False),
        _columnar("arrow-new", arrow=True, per_source=True),
        _columnar("msgpack-all", arrow=False, per_source=False),
        _columnar("msgpack-new", arrow=False, per_source=True),
    ]


# ---------------------------------------------------------------------------------------------------
# Measuring.


_clock = time.process_time_ns  # CPU time of this process: the machine's other work shows less


def _ns(t0: int, rows: int) -> float:
    return (_clock() - t0) / rows


def measure(
    cand: Candidate, warm: list[list[Entry]], msgs: list[list[Entry]], rows: int, traffic: Traffic
) -> dict[str, float]:
    """One pass of ``cand`` over the messages: per row, encode, bytes, decode, and decode + each fold."""
    out: dict[str, float] = {}
    encode = cand.new_encoder(traffic.source, traffic.seq_start)
    warm_bodies = [encode(m) for m in warm]
    gc.collect()
    t0 = _clock()
    bodies = [encode(m) for m in msgs]
    out["encode"] = _ns(t0, rows)
    out["bytes"] = sum(map(len, bodies)) / rows

    def decoder() -> Callable[[bytes], Any]:
        decode = cand.new_decoder()
        for b in warm_bodies:
            decode(b)
        return decode

    decode = decoder()
    gc.collect()
    t0 = _clock()
    for b in bodies:
        decode(b)
    out["decode"] = _ns(t0, rows)
    if cand.name == "json":
        gc.collect()
        t0 = _clock()
        for b in bodies:
            decode_batch(b, max_events=1 << 30)
        out["decode_structs"] = _ns(t0, rows)
        gc.collect()
        t0 = _clock()
        for b in bodies:
            _json_today(b)
        out["fold:fold_into (today)"] = _ns(t0, rows)
        return out
    for method, fold in cand.folds.items():
        decode = decoder()
        gc.collect()
        t0 = _clock()
        for b in bodies:
            fold(decode(b))
        out[f"fold:{method}"] = _ns(t0, rows)
    out["events"] = other_events_cost(traffic.source, msgs, rows)
    return out


def other_events_cost(source: ev.Source, msgs: list[list[Entry]], rows: int) -> float:
    """What the events other than steps cost the ledger per row in a columnar message: decoding them
    (msgspec, the contract's Structs), checking them and folding them (``fold_into``)."""
    blobs = []
    seq = 0
    for m in msgs:
        events, seq = reference_events(m, seq)
        blobs.append(_envelope_encoder.encode([e for e in events if type(e) is not ev.Step]))
    no_steps = np.zeros(0, np.int64)
    gc.collect()
    t0 = _clock()
    for blob in blobs:
        events = _events_validator.decode(blob)
        event_errors(source, events, _positions(no_steps, [e.seq for e in events])[1])
        fold_into({}, source, events)
    return _ns(t0, rows)


def run(
    traffic: Traffic,
    sizes: list[int],
    reps: int,
    cands: list[Candidate],
    say: Callable[[str], None] = lambda s: None,
) -> dict[int, dict[str, dict[str, list[float]]]]:
    """Per size, per candidate, per metric: the ``reps`` samples (candidates alternating, rotated)."""
    samples: dict[int, dict[str, dict[str, list[float]]]] = {n: {c.name: {} for c in cands} for n in sizes}
    cut = {n: traffic.messages(n) for n in sizes}
    for rep in range(reps):
        for n in sizes:
            warm, msgs, rows = cut[n]
            order = cands[rep % len(cands) :] + cands[: rep % len(cands)]
            for cand in order:
                got = measure(cand, warm, msgs, sum(rows), traffic)
                for metric, v in got.items():
                    samples[n][cand.name].setdefault(metric, []).append(v)
        say(f"rep {rep + 1}/{reps}")
    return samples


def summarise(samples: dict[int, dict[str, dict[str, list[float]]]]) -> dict[int, dict[str, dict[str, Any]]]:
    """Medians, and per candidate the fastest fold (its decode + fold figure)."""
    out: dict[int, dict[str, dict[str, Any]]] = {}
    for n, by_cand in samples.items():
        out[n] = {}
        for name, metrics in by_cand.items():
            med = {m: statistics.median(v) for m, v in metrics.items()}
            folds = {m[5:]: v for m, v in med.items() if m.startswith("fold:")}
            best = min(folds, key=folds.__getitem__)
            out[n][name] = {**med, "fold": folds[best], "fold_method": best}
    return out


def fit(summary: dict[int, dict[str, dict[str, Any]]], rows_per_message: dict[int, float]) -> dict[str, Any]:
    """Each candidate's encode, decode and decode + fold as ``fixed µs a message + ns a row``, a least
    squares line through the sizes' medians (ns/row = fixed / rows a message + per row)."""
    sizes = sorted(summary)
    if len(sizes) < 2:
        return {}
    x = np.array([1.0 / rows_per_message[n] for n in sizes])
    out: dict[str, Any] = {}
    for name in summary[sizes[0]]:
        out[name] = {}
        for metric in ("encode", "decode", "fold"):
            y = np.array([summary[n][name][metric] for n in sizes])
            slope, intercept = np.polyfit(x, y, 1)
            out[name][metric] = {"per_message_us": slope / 1000, "per_row_ns": intercept}
    return out


# ---------------------------------------------------------------------------------------------------
# The engine side's dependency weight.

_IMPORT_PROBE = """
import json, sys, time
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
base = {base!r}
t = time.perf_counter()
for m in base:
    __import__(m)
t_base = time.perf_counter() - t
r0 = rss()
had = "pyarrow" in sys.modules
t = time.perf_counter()
import pyarrow, pyarrow.ipc
t_pa = time.perf_counter() - t
r1 = rss()
out = {{"had_pyarrow": had, "base_s": t_base, "import_s": t_pa, "rss_added": r1 - r0, "rss_base": r0}}
print(json.dumps(out))
"""


def _installed_mb(module: Any) -> float:
    from pathlib import Path

    root = Path(module.__file__).parent
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) / 2**20


def import_costs(reps: int = 3, vllm: bool = True) -> dict[str, Any]:
    """Importing pyarrow (and pyarrow.ipc) in a fresh interpreter: after the exporter's own imports
    (msgspec, numpy), and after vLLM's engine core (what an engine process has loaded); medians. And
    the size installed of pyarrow beside msgspec's."""
    bases = {"exporter (msgspec, numpy)": ["msgspec", "numpy", "engine_hooks.exporter"]}
    if vllm:
        bases["vLLM engine core (vllm.v1.engine.core)"] = ["msgspec", "numpy", "vllm", "vllm.v1.engine.core"]
    out: dict[str, Any] = {"installed_mb": {"pyarrow": _installed_mb(pa), "msgspec": _installed_mb(msgspec)}}
    for label, base in bases.items():
        runs = []
        for _ in range(reps):
            proc = subprocess.run(
                [sys.executable, "-c", _IMPORT_PROBE.format(base=base)],
                capture_output=True,
                text=True,
                timeout=300,
            )
            if proc.returncode:
                out[label] = {"error": proc.stderr.strip().splitlines()[-1:]}
                break
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        if runs:
            out[label] = {
                "pyarrow_already_imported": any(r["had_pyarrow"] for r in runs),
                "import_ms": statistics.median(r["import_s"] for r in runs) * 1e3,
                "rss_added_mb": statistics.median(r["rss_added"] for r in runs) / 2**20,
                "rss_before_mb": statistics.median(r["rss_base"] for r in runs) / 2**20,
            }
    return out


# ---------------------------------------------------------------------------------------------------
# The command.


def table(
    summary: dict[int, dict[str, dict[str, Any]]], rows_per_message: dict[int, float], reps: int
) -> str:
    lines = []
    for n, by_cand in summary.items():
        names = list(by_cand)
        lines.append(
            f"\n{n} steps a message (about {rows_per_message[n]:,.0f} rows), "
            f"medians of {reps} alternating runs"
        )
        lines.append(f"  {'per row (one request in one step)':38s}" + "".join(f"{c:>14s}" for c in names))
        fmt: list[tuple[str, str, str]] = [
            ("exporter encode, ns", "encode", "{:.0f}"),
            ("message, bytes", "bytes", "{:.1f}"),
            ("ledger decode to columns, ns", "decode", "{:.0f}"),
            ("ledger decode + fold, ns", "fold", "{:.0f}"),
        ]
        for label, key, f in fmt:
            lines.append(f"  {label:38s}" + "".join(f"{f.format(by_cand[c][key]):>14s}" for c in names))
        lines.append(f"  {'  fold used':38s}" + "".join(f"{by_cand[c]['fold_method']:>14s}" for c in names))
        cells = "".join(
            f"{by_cand[c]['events']:>14.0f}" if "events" in by_cand[c] else f"{'':>14s}" for c in names
        )
        lines.append(f"  {'  of which the other events, ns':38s}{cells}")
        if "json" in by_cand and "decode_structs" in by_cand["json"]:
            lines.append(
                f"  {'  (json: decode_batch to Structs only)':38s}{by_cand['json']['decode_structs']:>14.0f}"
            )
        folds = sorted({m for c in names for m in by_cand[c] if m.startswith("fold:")})
        for m in folds:
            if m == "fold:fold_into (today)":
                continue
            cells = "".join(f"{by_cand[c][m]:>14.0f}" if m in by_cand[c] else f"{'':>14s}" for c in names)
            lines.append(f"  {'  decode + ' + m[5:]:38s}{cells}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps-per-message", default="8,16,64", help="comma-separated sizes")
    ap.add_argument("--steps", type=int, default=1024, help="timed engine steps (each size cuts them)")
    ap.add_argument("--warmup", type=int, default=64, help="steps before the timed ones (books warm)")
    ap.add_argument("--running", type=int, default=256, help="requests running in the engine")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--multi-token-share", type=float, default=0.0, help="decodes getting 2-3 tokens")
    ap.add_argument("--no-token-ids", dest="token_ids", action="store_false", help="steps without ids")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", dest="json_path", help="write the figures here")
    ap.add_argument("--candidates", default="", help="comma-separated subset (default: all)")
    ap.add_argument("--no-imports", dest="imports", action="store_false", help="skip the import probe")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.steps_per_message.split(",")]
    traffic = generate(
        steps=args.steps,
        warmup=args.warmup,
        running=args.running,
        seed=args.seed,
        multi_token_share=args.multi_token_share,
        token_ids=args.token_ids,
    )
    cands = candidates()
    if args.candidates:
        wanted = args.candidates.split(",")
        cands = [c for c in cands if c.name in wanted]

    def say(msg: str) -> None:
        print(f"[wire] {msg}", file=sys.stderr, flush=True)

    rare = sum(1 for st in traffic.steps for lay, _ in st if lay.kind is not ev.Step and not lay.many)
    rare += sum(len(v) for st in traffic.steps for lay, v in st if lay.many)
    rows = sum(traffic.rows)
    say(
        f"{len(traffic.steps)} steps, {rows:,} rows, "
        f"{rare:,} other events ({rare / len(traffic.steps):.2f} a step)"
    )
    samples = run(traffic, sizes, args.reps, cands, say)
    summary = summarise(samples)
    per_msg = {n: rows / len(traffic.messages(n)[1]) for n in sizes}
    print(table(summary, per_msg, args.reps))
    lines = fit(summary, per_msg)
    if lines:
        print(f"\nfitted over the sizes: fixed µs a message + ns a row ({', '.join(map(str, sizes))} steps)")
        print(f"  {'':14s}" + "".join(f"{m:>24s}" for m in ("exporter encode", "decode", "decode + fold")))
        for name, got in lines.items():
            cells = "".join(
                f"{got[m]['per_message_us']:>9.0f} µs + {got[m]['per_row_ns']:>5.0f} ns"
                for m in ("encode", "decode", "fold")
            )
            print(f"  {name:14s}{cells}")
    imports: dict[str, Any] = {}
    if args.imports:
        say("import probe (fresh interpreters)")
        imports = import_costs()
        print("\nengine side: importing pyarrow + pyarrow.ipc (medians of 3 fresh interpreters)")
        sizes_mb = imports["installed_mb"]
        print(f"  installed: pyarrow {sizes_mb['pyarrow']:.0f} MB, msgspec {sizes_mb['msgspec']:.1f} MB")
        for label, got in imports.items():
            if label == "installed_mb":
                continue
            if "error" in got:
                print(f"  after {label}: failed: {got['error']}")
                continue
            print(
                f"  after {label}: already imported: {got['pyarrow_already_imported']}; "
                f"+{got['rss_added_mb']:.1f} MB RSS (from {got['rss_before_mb']:.0f} MB), "
                f"{got['import_ms']:.0f} ms"
            )
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump(
                {
                    "command": " ".join(
                        ["python -m bench.wire", *(argv if argv is not None else sys.argv[1:])]
                    ),
                    "traffic": {
                        "steps": len(traffic.steps),
                        "rows": rows,
                        "other_events": rare,
                        "running": args.running,
                        "seed": args.seed,
                        "id_length": ID_LEN,
                        "token_ids": args.token_ids,
                    },
                    "content_types": {c.name: c.content_type for c in cands},
                    "medians": {str(n): v for n, v in summary.items()},
                    "fit": lines,
                    "samples": {str(n): v for n, v in samples.items()},
                    "imports": imports,
                },
                fh,
                indent=1,
            )


if __name__ == "__main__":
    main()
