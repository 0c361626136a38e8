"""Builders for realistic event sequences used across ledger tests."""

from __future__ import annotations

import msgspec

from engine_hooks import events as ev

ENGINE = ev.Source(id="engine-0", kind="engine", model="tiny-llama")
GATEWAY = ev.Source(id="gw-0", kind="gateway")


def lifecycle(rid: str, t0: float = 1_700_000_000.0, *, preempt: bool = True) -> tuple[list, list]:
    """(gateway events, engine events) of one request: entry, admission, chunks, a preemption, decode."""
    gw = [
        ev.Arrived(seq=0, ts=t0, request_id=rid, endpoint="/v1/completions", stream=True),
        ev.AdmissionEnqueued(seq=0, ts=t0 + 0.001, request_id=rid, queue_depth=2, entry_s=0.001),
        ev.Admitted(seq=0, ts=t0 + 0.101, request_id=rid, wait_s=0.1, in_flight=4),
        ev.FirstByte(seq=0, ts=t0 + 0.6, request_id=rid, since_arrived_s=0.6),
        ev.FirstTokenOut(seq=0, ts=t0 + 0.62, request_id=rid, since_arrived_s=0.62),
        ev.Completed(
            seq=0, ts=t0 + 2.0, request_id=rid, status_code=200, since_arrived_s=2.0, last_token_out_s=1.99
        ),
    ]
    en = [
        ev.Queued(seq=0, ts=t0 + 0.102, request_id=rid, prompt_tokens=300, max_tokens=64),
        ev.Chunk(
            seq=0,
            ts=t0 + 0.2,
            request_id=rid,
            step=1,
            tokens=128,
            computed_before=44,
            cached_tokens=44,
            kv_blocks=11,
            wait_s=0.098,
        ),
        ev.Chunk(seq=0, ts=t0 + 0.3, request_id=rid, step=2, tokens=128, computed_before=172, kv_blocks=19),
    ]
    if preempt:
        en += [
            ev.Preempted(seq=0, ts=t0 + 0.35, request_id=rid, kv_blocks_freed=19, computed_tokens=300),
            ev.Resumed(seq=0, ts=t0 + 0.45, request_id=rid, wait_s=0.1, cached_tokens=0),
            ev.Chunk(
                seq=0,
                ts=t0 + 0.5,
                request_id=rid,
                step=5,
                tokens=128,
                computed_before=0,
                kv_blocks=8,
                preemptions=1,
                recomputed_tokens=128,
            ),
        ]
    en += [
        ev.Tokens(seq=0, ts=t0 + 0.55, request_id=rid, count=1, total=1, kv_blocks=19, token_ids=[7]),
        ev.Tokens(
            seq=0,
            ts=t0 + 1.9,
            request_id=rid,
            count=9,
            total=10,
            first_ts=t0 + 0.6,
            kv_blocks=20,
            token_ids=list(range(9)),
        ),
        ev.Finished(seq=0, ts=t0 + 1.95, request_id=rid, reason="stop", output_tokens=10, stop_reason="eos"),
    ]
    return gw, en


def numbered(events: list, start: int = 1) -> list:
    return [msgspec.structs.replace(e, seq=start + i) for i, e in enumerate(events)]


def batch(source: ev.Source, events: list) -> ev.Batch:
    return ev.Batch(source=source, events=events)


def body(source: ev.Source, events: list) -> bytes:
    return ev.encode_batch(source, events)


def output_token_ids(events: list) -> dict[str, list[int]]:
    """Each request's output token ids in emit order, from ``tokens`` events and from the columns of
    ``step`` events (the two ways a source reports them)."""
    out: dict[str, list[int]] = {}
    for e in events:
        if isinstance(e, ev.Tokens):
            out.setdefault(e.request_id, []).extend(e.token_ids or [])
        elif isinstance(e, ev.Step):
            for rid, _count, _total, ids in e.token_groups():
                out.setdefault(rid, []).extend(ids)
    return out
