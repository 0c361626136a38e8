"""Grouping a batch's step token columns by request: numpy, the columnar message's columns and entry by
entry agree."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine_hooks import events as ev
from engine_hooks.columnar import encode_batch
from ledger.columnar import decode_columns
from ledger.rules import step_tokens

T0 = 1_800_000_000.0
ENGINE = ev.Source(id="engine-0", kind="engine", model="m")


@st.composite
def batches(draw):
    """Steps of one engine: each runs some of a few requests, with 0-3 new tokens each and running
    totals; some steps send no ids, some no token columns at all."""
    pool = [f"r{i}" for i in range(draw(st.integers(1, 40)))]
    totals = dict.fromkeys(pool, 0)
    out = []
    for k in range(draw(st.integers(0, 30))):
        runners = draw(st.lists(st.sampled_from(pool), max_size=40, unique=True))
        counts = [draw(st.integers(0, 3)) for _ in runners]
        for rid, c in zip(runners, counts, strict=True):
            totals[rid] += c
        columns = {}
        if draw(st.integers(0, 5)):
            columns = {"token_counts": counts, "token_totals": [totals[r] for r in runners]}
            if draw(st.integers(0, 3)):
                columns["token_ids"] = [draw(st.integers(0, 9)) for _ in range(sum(counts))]
        out.append(ev.Step(seq=k, ts=T0 + k, step=k, duration_s=0.01, request_ids=runners, **columns))
    return out


@settings(max_examples=150, deadline=None)
@given(batches())
def test_numpy_and_columns_grouping_give_the_groups_of_going_entry_by_entry(steps):
    small = step_tokens.group_small([s for s in steps if s.token_counts])
    old = step_tokens.NUMPY_MIN_ENTRIES
    step_tokens.NUMPY_MIN_ENTRIES = 0  # force the numpy path whatever the size
    try:
        grouped = step_tokens.group(steps)
    finally:
        step_tokens.NUMPY_MIN_ENTRIES = old
    assert grouped == small
    message = decode_columns(encode_batch(ev.Batch(source=ENGINE, events=steps)), max_events=10**6)
    assert step_tokens.group_columns(message.steps, message.ids) == small


def test_a_request_gets_its_highest_total_and_its_ids_in_emit_order():
    steps = [
        ev.Step(
            seq=k,
            ts=T0 + k,
            step=k,
            duration_s=0.01,
            request_ids=["a", "b", "c"],
            token_counts=[1, 0, 2],
            token_totals=[k + 1, 5, 2 * k + 2],
            token_ids=[10 + k, 20 + k, 30 + k],
        )
        for k in range(300)  # 900 entries: the numpy path
    ]
    groups = step_tokens.group(steps)
    assert [g[0] for g in groups] == ["a", "c"]  # b got no token
    (a_total, a_ids), (c_total, c_ids) = [(g[1], g[2]) for g in groups]
    assert a_total == 300 and a_ids == [10 + k for k in range(300)]
    assert c_total == 600 and c_ids == [t for k in range(300) for t in (20 + k, 30 + k)]
