"""The four-layer attribution of the ``requests`` view, on both backends.

Requests are generated with known layer durations (gateway or not, preemptions in prefill and in
decode, a finish while waiting, an abort before the first token, lost gateway events), their events
are shuffled into batches from two sources and stored through the real write path; the view must give
back the generated layers, and the layers must add up to end-to-end and to TTFT.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import msgspec
import pytest
import sqlalchemy as sa

from engine_hooks import events as ev
from ledger import schema
from tests.support.factories import ENGINE, GATEWAY, batch

T0 = 1_700_000_000.0
LAYERS = ("entry_s", "admission_s", "backend_wait_s", "prefill_s", "decode_s")
SPLIT_LAYERS = ("entry_s", "admission_s", "frontend_s", "engine_queue_s", "prefill_s", "decode_s")


@dataclass
class Case:
    rid: str
    gw: list = field(default_factory=list)
    en: list = field(default_factory=list)
    want: dict[str, float | None] = field(default_factory=dict)
    frontend: float = 0.0  # forwarded (or engine arrival) -> engine queued


def _generate(rng: random.Random, i: int) -> Case:
    """One request's events and the layers they must produce."""
    c = Case(rid=f"r{i:04d}")
    rid = c.rid
    t = T0 + i * 10
    gateway = rng.random() < 0.7
    entry = admission = 0.0
    if gateway:
        start = t
        entry, admission = rng.uniform(0, 0.01), rng.choice([0.0, rng.uniform(0, 2)])
        c.gw.append(ev.Arrived(seq=0, ts=t, request_id=rid))
        enq = ev.AdmissionEnqueued(seq=0, ts=t + entry, request_id=rid, entry_s=entry)
        t += entry + admission
        if rng.random() < 0.15:  # admission_enqueued lost: entry runs to the forward, admission is 0
            entry, admission = entry + admission, 0.0
        else:
            c.gw.append(enq)
        c.gw.append(ev.Admitted(seq=0, ts=t, request_id=rid, wait_s=admission))
        net = rng.uniform(0, 0.005)
        t += net
        backend = c.frontend = net  # forwarded -> engine queued: the front end, in the backend wait
        c.en.append(ev.Queued(seq=0, ts=t, request_id=rid, prompt_tokens=100))
    else:
        fe = rng.uniform(0, 0.01)  # engine front end: arrival -> queued, in the backend wait
        start = t
        c.en.append(ev.Queued(seq=0, ts=t + fe, request_id=rid, prompt_tokens=100, arrival_ts=t))
        t += fe
        backend = c.frontend = fe
    first_wait = rng.uniform(0, 1)
    outcome = rng.choice(["normal", "normal", "never_scheduled", "abort_in_prefill", "wait_at_end"])
    if outcome == "never_scheduled":
        t += first_wait
        c.en.append(ev.Finished(seq=0, ts=t, request_id=rid, reason="abort", wait_s=first_wait))
        c.want = dict(entry_s=entry, admission_s=admission, backend_wait_s=backend + first_wait)
        c.want.update(prefill_s=0.0, decode_s=0.0, ttft_s=None)
        return _end(c, rng, gateway, t, start)
    t += first_wait
    backend += first_wait
    measured = first_wait
    if rng.random() < 0.4:  # the engine's own clock: a little off the timestamps, or beyond the wait
        measured = max(0.0, first_wait + rng.choice([rng.uniform(-0.002, 0.002), c.frontend + 0.01]))
    # engine_queue_s's first wait is the measured one, kept within forwarded -> first scheduled; the
    # front end is the rest of it
    span = c.frontend + first_wait
    c.frontend = span - min(measured, span)
    c.en.append(ev.Chunk(seq=0, ts=t, request_id=rid, step=1, tokens=64, computed_before=0, wait_s=measured))
    prefill = decode = 0.0
    ttft_wait = backend
    d = rng.uniform(0.01, 0.2)
    t += d
    prefill += d
    if rng.random() < 0.4:  # preempted during prefill
        c.en.append(ev.Preempted(seq=0, ts=t, request_id=rid))
        w = rng.uniform(0, 1)
        t += w
        backend += w
        ttft_wait += w
        c.en.append(ev.Resumed(seq=0, ts=t, request_id=rid, wait_s=w, output_tokens=0))
        d = rng.uniform(0.01, 0.2)
        t += d
        prefill += d
    if outcome == "abort_in_prefill":
        c.en.append(ev.Finished(seq=0, ts=t, request_id=rid, reason="abort"))
        c.want = dict(entry_s=entry, admission_s=admission, backend_wait_s=backend, prefill_s=prefill)
        c.want.update(decode_s=0.0, ttft_s=None)
        return _end(c, rng, gateway, t, start)
    c.en.append(ev.Tokens(seq=0, ts=t, request_id=rid, count=1, total=1))
    ttft = t - start
    if gateway and rng.random() < 0.8:
        c.gw.append(ev.FirstByte(seq=0, ts=t - 0.001, request_id=rid))  # headers: before any token
    if gateway and rng.random() < 0.8:  # the first token's way back to the client
        delivery = rng.uniform(0, 0.05)
        c.gw.append(ev.FirstTokenOut(seq=0, ts=t + delivery, request_id=rid))
        c.want.update(client_ttft_s=ttft + delivery, delivery_s=delivery)
    else:
        c.want.update(client_ttft_s=None, delivery_s=None)
    d = rng.uniform(0.01, 1)
    t += d
    decode += d
    if rng.random() < 0.4 or outcome == "wait_at_end":  # preempted during decode
        c.en.append(ev.Preempted(seq=0, ts=t, request_id=rid))
        w = rng.uniform(0, 1)
        t += w
        backend += w
        if outcome == "wait_at_end":  # finished while waiting after the preemption
            c.en.append(ev.Finished(seq=0, ts=t, request_id=rid, reason="abort", wait_s=w))
            c.want = dict(entry_s=entry, admission_s=admission, backend_wait_s=backend, prefill_s=prefill)
            c.want.update(decode_s=decode, ttft_s=ttft, backend_wait_ttft_s=ttft_wait)
            return _end(c, rng, gateway, t, start)
        c.en.append(ev.Resumed(seq=0, ts=t, request_id=rid, wait_s=w, output_tokens=5))
        d = rng.uniform(0.01, 1)
        t += d
        decode += d
    c.en.append(ev.Tokens(seq=0, ts=t, request_id=rid, count=9, total=10))
    c.en.append(ev.Finished(seq=0, ts=t, request_id=rid, reason="stop", output_tokens=10))
    c.want = dict(entry_s=entry, admission_s=admission, backend_wait_s=backend, prefill_s=prefill)
    c.want.update(decode_s=decode, ttft_s=ttft, backend_wait_ttft_s=ttft_wait)
    return _end(c, rng, gateway, t, start)


def _end(c: Case, rng: random.Random, gateway: bool, t: float, start: float) -> Case:
    if gateway:  # the gateway finishes the response a little after the engine
        tail = rng.uniform(0, 0.005)
        c.gw.append(ev.Completed(seq=0, ts=t + tail, request_id=c.rid))
        c.want["decode_s"] = (c.want["decode_s"] or 0.0) + tail if c.want["ttft_s"] is not None else 0.0
        if c.want["ttft_s"] is None:  # no token: the tail is still prefill (or backend wait)
            key = "prefill_s" if c.want["prefill_s"] else "backend_wait_s"
            c.want[key] = (c.want[key] or 0.0) + tail
        t += tail
    c.want["e2e_s"] = t - start
    c.want["frontend_s"] = c.frontend
    c.want["engine_queue_s"] = c.want["backend_wait_s"] - c.frontend  # queued -> scheduled, re-waits
    return c


def _store_shuffled(store, cases: list[Case], rng: random.Random) -> None:
    """Every event in a random order, cut into random batches per source (seqs follow send order)."""
    for src, key in ((GATEWAY, "gw"), (ENGINE, "en")):
        evs = [e for c in cases for e in getattr(c, key)]
        rng.shuffle(evs)
        seq = 1
        while evs:
            n = rng.randint(1, 40)
            part, evs = evs[:n], evs[n:]
            store.write([batch(src, [msgspec.structs.replace(e, seq=seq + k) for k, e in enumerate(part)])])
            seq += len(part)


def _rows(store) -> dict[str, dict]:
    with store.engine.connect() as conn:
        rows = conn.execute(sa.select(schema.requests)).mappings().all()
    return {r["request_id"]: dict(r) for r in rows}


def test_layers_add_up_and_match_the_generated_durations(store):
    rng = random.Random(11)
    cases = [_generate(rng, i) for i in range(300)]
    _store_shuffled(store, cases, rng)
    rows = _rows(store)
    assert len(rows) == len(cases)
    for c in cases:
        row = rows[c.rid]
        total = sum(row[k] for k in LAYERS)
        assert total == pytest.approx(row["e2e_s"], abs=1e-6), c.rid
        assert sum(row[k] for k in SPLIT_LAYERS) == pytest.approx(row["e2e_s"], abs=1e-6), c.rid
        assert row["frontend_s"] + row["engine_queue_s"] == row["backend_wait_s"], c.rid  # to the bit
        for k, v in c.want.items():
            if v is None:
                assert row[k] is None, (c.rid, k)
            else:
                assert row[k] == pytest.approx(v, abs=1e-5), (c.rid, k, c.en, c.gw)
        if row["ttft_s"] is not None:
            ttft_parts = row["entry_s"] + row["admission_s"] + row["backend_wait_ttft_s"] + row["prefill_s"]
            assert ttft_parts == pytest.approx(row["ttft_s"], abs=1e-6), c.rid


def test_live_requests_have_no_layers_but_ttft_once_the_first_token_is_out(store):
    rid = "live"
    store.write(
        [
            batch(
                ENGINE,
                [
                    ev.Queued(seq=1, ts=T0, request_id=rid, prompt_tokens=10),
                    ev.Chunk(seq=2, ts=T0 + 0.5, request_id=rid, step=0, tokens=10, computed_before=0),
                ],
            )
        ]
    )
    row = _rows(store)[rid]
    assert all(row[k] is None for k in (*LAYERS, "e2e_s", "ttft_s"))
    store.write([batch(ENGINE, [ev.Tokens(seq=3, ts=T0 + 0.7, request_id=rid, count=1, total=1)])])
    row = _rows(store)[rid]
    assert row["ttft_s"] == pytest.approx(0.7) and row["e2e_s"] is None
