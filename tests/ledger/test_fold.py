"""Folding is a function of the set of events: order, batching and sources do not matter."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_hooks import events as ev
from ledger.fold import AGGREGATES, fold, fold_into, fold_step, fold_steps, merge
from tests.support.factories import ENGINE, GATEWAY, lifecycle

T0 = 1_700_000_000.0


@st.composite
def request_events(draw):
    """A plausible event set for one request: optional gateway, chunks, preemptions, token groups."""
    rid = "r"
    prompt = draw(st.integers(1, 5000))
    cached = draw(st.integers(0, prompt - 1))
    out: list[tuple[ev.Source, object]] = []
    t = T0
    if draw(st.booleans()):
        out += [
            (GATEWAY, ev.Arrived(seq=0, ts=t, request_id=rid)),
            (GATEWAY, ev.AdmissionEnqueued(seq=0, ts=t + 0.001, request_id=rid, entry_s=0.001)),
            (GATEWAY, ev.Admitted(seq=0, ts=t + draw(st.floats(0.002, 3)), request_id=rid, wait_s=0.5)),
        ]
    out.append((ENGINE, ev.Queued(seq=0, ts=t + 3, request_id=rid, prompt_tokens=prompt)))
    budget = draw(st.integers(16, 2048))
    done, step, preemptions, high = cached, 0, 0, cached
    while done < prompt:
        n = min(budget, prompt - done)
        first = done == cached and preemptions == 0
        new = max(0, done + n - max(done, high))
        out.append(
            (
                ENGINE,
                ev.Chunk(
                    seq=0,
                    ts=t + 4 + step,
                    request_id=rid,
                    step=step,
                    tokens=n,
                    computed_before=done,
                    cached_tokens=cached if first else 0,
                    recomputed_tokens=n - new,
                    preemptions=preemptions,
                    wait_s=0.25 if first else None,
                ),
            )
        )
        done += n
        high = max(high, done)
        step += 1
        if done < prompt and draw(st.integers(0, 9)) == 0:
            out.append((ENGINE, ev.Preempted(seq=0, ts=t + 4 + step, request_id=rid)))
            out.append((ENGINE, ev.Resumed(seq=0, ts=t + 4.5 + step, request_id=rid, wait_s=0.5)))
            preemptions += 1
            done = 0
    total = 0
    for g in range(draw(st.integers(0, 6))):
        c = draw(st.integers(1, 50))
        total += c
        out.append((ENGINE, ev.Tokens(seq=0, ts=t + 100 + g, request_id=rid, count=c, total=total)))
    if draw(st.booleans()):
        out.append(
            (ENGINE, ev.Finished(seq=0, ts=t + 200, request_id=rid, reason="stop", output_tokens=total))
        )
    return out


def _close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == (pytest.approx(b[k]) if isinstance(b[k], float) else b[k]), k


@settings(max_examples=200, deadline=None)
@given(request_events(), st.randoms(use_true_random=False))
def test_fold_is_independent_of_event_order_and_batching(pairs, rnd):
    expected = fold(pairs)["r"]
    shuffled = list(pairs)
    rnd.shuffle(shuffled)
    # Fold random slices separately, then merge the partial rows in a random order.
    cuts = sorted(rnd.sample(range(len(shuffled) + 1), k=min(3, len(shuffled) + 1)))
    parts = [shuffled[a:b] for a, b in zip([0, *cuts], [*cuts, len(shuffled)], strict=True)]
    partials = []
    for part in parts:
        rows: dict = {}
        for src, e in part:
            fold_into(rows, src, [e])
        if rows:
            partials.append(rows["r"])
    rnd.shuffle(partials)
    merged: dict = {}
    for p in partials:
        merged = merge(merged, p)
    _close(merged, expected)


@settings(max_examples=100, deadline=None)
@given(request_events())
def test_first_pass_token_ledger_adds_up_to_the_prompt(pairs):
    row = fold(pairs)["r"]
    queued = next(e for _, e in pairs if isinstance(e, ev.Queued))
    assert row.get("cached_tokens", 0) + row["prefill_computed_tokens"] == queued.prompt_tokens
    assert row.get("preemptions", 0) == row.get("resumes", 0)
    assert row["chunks"] == sum(isinstance(e, ev.Chunk) for _, e in pairs)


def test_every_aggregate_column_is_reachable_from_some_event():
    gw, en = lifecycle("r")
    extra = [
        (GATEWAY, ev.ClientDisconnected(seq=0, ts=T0 + 9, request_id="r")),
        (GATEWAY, ev.StreamCut(seq=0, ts=T0 + 9, request_id="r", rule="loop")),
        (
            GATEWAY,
            ev.Arrived(
                seq=0, ts=T0, request_id="r", trace_id="ab" * 16, parent_span_id="cd" * 8, span_id="ef" * 8
            ),
        ),
        # A decode-phase preemption, a finish while waiting, a step run and a step sat out.
        (ENGINE, ev.Resumed(seq=0, ts=T0 + 9, request_id="r", wait_s=0.2, output_tokens=5)),
        (ENGINE, ev.Finished(seq=0, ts=T0 + 9, request_id="r", reason="abort", wait_s=0.1)),
        (ENGINE, ev.Step(seq=0, ts=T0, step=0, duration_s=0.01, request_ids=["r"])),
        (
            ENGINE,
            ev.Step(seq=0, ts=T0, step=1, duration_s=0.01, stalled_request_ids=["r"], stalled_kv_blocks=[4]),
        ),
    ]
    row = fold([(GATEWAY, e) for e in gw] + [(ENGINE, e) for e in en] + extra)["r"]
    missing = set(AGGREGATES) - set(row)
    assert missing == set()


def test_dropped_markers_do_not_create_request_rows():
    rows = fold([(ENGINE, ev.Dropped(seq=2, ts=T0, count=3, reason="queue_full"))])
    assert rows == {}


def test_steps_fold_participation_into_runners_and_kv_idle_into_stalled_requests():
    rows = fold(
        [
            (ENGINE, ev.Step(seq=1, ts=T0, step=0, duration_s=0.01, request_ids=["a", "b"])),
            (
                ENGINE,
                ev.Step(
                    seq=2,
                    ts=T0 + 0.02,
                    step=1,
                    duration_s=0.03,
                    request_ids=["a"],
                    stalled_request_ids=["b"],
                    stalled_kv_blocks=[12],
                ),
            ),
        ]
    )
    a, b = rows["a"], rows["b"]
    assert a["step_count"] == 2 and a["active_s"] == pytest.approx(0.04)
    assert a["last_step_ts"] == pytest.approx(T0 + 0.05)
    assert "kv_idle_s" not in a
    assert b["step_count"] == 1 and b["last_step_ts"] == pytest.approx(T0 + 0.01)
    assert b["stalled_steps"] == 1 and b["kv_idle_s"] == pytest.approx(0.03)
    assert b["kv_idle_block_s"] == pytest.approx(0.36)


def _assert_same_rows(got_rows: dict, want_rows: dict) -> None:
    """The same requests, each with the same columns and values (floats approximately)."""
    assert got_rows.keys() == want_rows.keys()
    for rid, want in want_rows.items():
        got = got_rows[rid]
        assert got.keys() == want.keys(), rid
        for k, v in want.items():
            assert got[k] == (pytest.approx(v) if isinstance(v, float) else v), (rid, k)


@st.composite
def busy_steps(draw):
    """Steps of a busy engine: many runners each, some stalled requests (blocks aligned or not)."""
    ids = [f"r{i}" for i in range(draw(st.integers(1, 60)))]
    out = []
    for k in range(draw(st.integers(1, 40))):
        runners = draw(st.lists(st.sampled_from(ids), max_size=40, unique=True))
        stalled = draw(st.lists(st.sampled_from(ids), max_size=6, unique=True))
        n_blocks = len(stalled) if draw(st.booleans()) else draw(st.integers(0, 6))
        counts = totals = []
        if draw(st.booleans()):  # the step carries its output tokens (schema 2)
            counts = draw(st.lists(st.integers(0, 3), min_size=len(runners), max_size=len(runners)))
            totals = [c + draw(st.integers(0, 5000)) for c in counts]
        out.append(
            ev.Step(
                seq=k,
                ts=T0 + draw(st.floats(0, 100)),
                step=k,
                duration_s=draw(st.floats(0.001, 0.5)),
                request_ids=runners,
                stalled_request_ids=stalled,
                stalled_kv_blocks=draw(st.lists(st.integers(0, 500), min_size=n_blocks, max_size=n_blocks)),
                token_counts=counts,
                token_totals=totals,
            )
        )
    return out


@settings(max_examples=60, deadline=None)
@given(busy_steps())
def test_steps_folded_as_columns_give_the_rows_of_folding_them_one_by_one(steps):
    one_by_one: dict = {}
    for s in steps:
        fold_step(one_by_one, s)
    grouped: dict = {}
    fold_steps(grouped, steps)
    _assert_same_rows(grouped, one_by_one)


@settings(max_examples=60, deadline=None)
@given(busy_steps(), st.data())
def test_a_groups_messages_folded_at_once_give_the_rows_of_folding_their_steps_one_by_one(steps, data):
    """The store folds every columnar message of a group in one pass, the requests named across the
    messages by their keys (any integers, shared by an id in every message that names it)."""
    import numpy as np

    from ledger.columnar import steps_of
    from ledger.fold import fold_step_columns

    steps = [
        s for s in steps if not s.stalled_kv_blocks or len(s.stalled_kv_blocks) == len(s.stalled_request_ids)
    ]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(steps)), max_size=4)))
    pieces = [steps[a:b] for a, b in zip([0, *cuts], [*cuts, len(steps)], strict=True)]
    key = {f"r{i}": data.draw(st.integers(0, 10**9), label="key") for i in range(60)}
    if len(set(key.values())) < len(key):
        return
    parts = []
    for piece in pieces:
        if piece:
            cols, ids = steps_of(piece)
            parts.append((cols, ids, np.array([key[rid] for rid in ids], np.int64)))
    one_by_one: dict = {}
    for s in steps:
        fold_step(one_by_one, s)
    folded: dict = {}
    fold_step_columns(parts).into(folded)
    _assert_same_rows(folded, one_by_one)


def test_a_busy_groups_steps_take_the_columns_path(monkeypatch):
    """The columns fold is used above the threshold (else the property test above tests nothing)."""
    import ledger.fold as fold_module

    calls = []
    monkeypatch.setattr(fold_module, "fold_step", lambda rows, s: calls.append(s))
    steps = [
        ev.Step(seq=k, ts=T0 + k, step=k, duration_s=0.01, request_ids=[f"r{i}" for i in range(32)])
        for k in range(10)
    ]
    rows: dict = {}
    fold_module.fold_steps(rows, steps)
    assert calls == [] and rows["r0"]["step_count"] == 10
    fold_module.fold_steps({}, steps[:2])  # 64 participants: one by one
    assert len(calls) == 2


def test_tokens_carried_by_steps_fold_like_tokens_events_at_the_steps_ends():
    ends = [T0 + 1.0, T0 + 1.5, T0 + 2.5]  # ts + duration_s of each step below
    steps = [
        ev.Step(
            seq=10 + k,
            ts=end - 0.25,
            step=k,
            duration_s=0.25,
            request_ids=["a", "b"],
            token_counts=[1, c],
            token_totals=[k + 1, t],
            token_ids=[7, *range(c)],
        )
        for k, (end, c, t) in enumerate(zip(ends, [0, 2, 1], [0, 2, 3], strict=True))
    ]
    events = [
        ev.Tokens(seq=1, ts=ends[0], request_id="a", count=1, total=1),
        ev.Tokens(seq=2, ts=ends[1], request_id="a", count=1, total=2),
        ev.Tokens(seq=3, ts=ends[2], request_id="a", count=1, total=3),
        ev.Tokens(seq=4, ts=ends[1], request_id="b", count=2, total=2),
        ev.Tokens(seq=5, ts=ends[2], request_id="b", count=1, total=3),
    ]
    by_events = fold([(ENGINE, e) for e in events])
    by_steps = fold([(ENGINE, s) for s in steps])
    for rid, first, last in (("a", ends[0], ends[2]), ("b", ends[1], ends[2])):
        for rows in (by_events, by_steps):
            row = rows[rid]
            assert row["first_token_ts"] == pytest.approx(first) and row["output_tokens"] == 3
            assert row["last_token_ts"] == pytest.approx(last) == row["last_event_ts"]
        assert "token_events" not in by_steps[rid]  # no event of its own
    grouped: dict = {}
    fold_steps(grouped, steps * 100)  # the columns path: the same rows
    for rid in ("a", "b"):
        for k in ("first_token_ts", "last_token_ts", "output_tokens"):
            assert grouped[rid][k] == pytest.approx(by_steps[rid][k])


def test_trace_context_comes_from_the_gateway_or_without_one_from_the_engine():
    trace, caller, gateway_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", "b7ad6b7169203331"
    gw = [
        (
            GATEWAY,
            ev.Arrived(
                seq=0, ts=T0, request_id="g", trace_id=trace, parent_span_id=caller, span_id=gateway_span
            ),
        )
    ]
    en = [
        (
            ENGINE,
            ev.Queued(seq=0, ts=T0, request_id="e", prompt_tokens=3, trace_id=trace, parent_span_id=caller),
        )
    ]
    rows = fold(gw + en)
    assert (rows["g"]["trace_id"], rows["g"]["parent_span_id"], rows["g"]["span_id"]) == (
        trace,
        caller,
        gateway_span,
    )
    assert (rows["e"]["trace_id"], rows["e"]["parent_span_id"], rows["e"].get("span_id")) == (
        trace,
        caller,
        None,
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("trace_id", "0" * 32),
        ("trace_id", "AB" * 16),
        ("trace_id", "ab" * 15),
        ("span_id", "0" * 16),
        ("parent_span_id", "xyz"),
    ],
)
def test_trace_ids_that_are_not_w3c_ids_are_refused_naming_the_field(field, value):
    import msgspec

    body = {"kind": "arrived", "seq": 0, "ts": T0, "request_id": "r", field: value}
    with pytest.raises(msgspec.ValidationError, match=field):
        msgspec.convert(body, ev.Arrived)
