"""The event stream LedgerScheduler sends from a real vLLM engine (tiny model, CPU, in-process)."""

from __future__ import annotations

import pytest

from engine_hooks.events import Chunk, Finished, Preempted, Queued, Resumed, Step, Tokens
from tests.engine_hooks.vllm.vllm_helpers import BUDGET, events_of, prompt, rid
from tests.support.factories import output_token_ids
from tests.support.fake_ledger import FakeLedger, wait_until

pytestmark = pytest.mark.vllm


@pytest.fixture
def ledger():
    fake = FakeLedger()
    yield fake
    fake.stop()


def _events(ledger: FakeLedger, exporter) -> list:
    assert exporter.force_flush(10.0)
    return list(ledger.store.events)


def test_chunks_never_exceed_the_budget_and_add_up_to_the_prompt(engine, attach, ledger):
    exporter = attach(ledger.url)
    r = rid("chunks")
    engine.add(r, prompt(1000), max_tokens=4)
    out = engine.run()[r]
    events = _events(ledger, exporter)

    chunks = events_of(events, Chunk, r)
    assert [c.tokens for c in chunks] == [128] * 7 + [104]
    assert [c.computed_before for c in chunks] == [128 * i for i in range(8)]
    assert all(c.recomputed_tokens == 0 and c.preemptions == 0 for c in chunks)
    assert chunks[0].cached_tokens == 0 and chunks[0].wait_s is not None
    assert all(c.wait_s is None for c in chunks[1:])
    size = engine.scheduler.block_size
    assert [c.kv_blocks for c in chunks] == [-(-min(128 * (i + 1), 1000) // size) for i in range(8)]

    (queued,) = events_of(events, Queued, r)
    assert queued.prompt_tokens == 1000 and queued.max_tokens == 4 and queued.arrival_ts is not None

    steps = [s for s in events_of(events, Step) if r in s.request_ids]
    assert steps and all(s.prefill_tokens + s.decode_tokens <= BUDGET for s in steps)
    by_step = {c.step: c for c in chunks}
    for s in steps:
        if s.step in by_step:
            c = by_step[s.step]
            assert s.prefill_tokens == c.tokens and s.num_prefill_reqs == 1
            assert s.prefill_depth_tokens == c.tokens * c.computed_before
            assert s.max_prefill_depth == c.computed_before
        else:
            assert s.decode_tokens == 1 and s.num_decode_reqs == 1 and s.prefill_tokens == 0
        assert s.duration_s > 0 and 0 < s.kv_usage <= 1
    assert len(steps) == 8 + 3  # the last chunk yields the first token, then three decodes

    tokens = events_of(events, Tokens, r)
    assert sum(t.count for t in tokens) == 4 and tokens[-1].total == 4
    assert [i for t in tokens for i in t.token_ids] == list(out.outputs[0].token_ids)
    (finished,) = events_of(events, Finished, r)
    assert finished.reason == "length" and finished.output_tokens == 4 and finished.wait_s is None
    kinds = [type(e).__name__ for e in events if getattr(e, "request_id", None) == r]
    assert kinds[0] == "Queued" and kinds[-1] == "Finished"
    assert engine.scheduler.hook_errors == 0


def test_prefix_cache_hits_are_reported_on_the_first_chunk(engine, attach, ledger):
    exporter = attach(ledger.url)
    shared = prompt(1000)
    first, second = rid("cold"), rid("warm")
    engine.add(first, shared, max_tokens=2)
    engine.run()
    engine.add(second, shared, max_tokens=2)
    engine.run()
    events = _events(ledger, exporter)
    warm = events_of(events, Chunk, second)
    cached = warm[0].cached_tokens
    assert cached > 0 and cached % engine.scheduler.block_size == 0 and cached == warm[0].computed_before
    assert sum(c.tokens for c in warm) == 1000 - cached
    assert all(c.cached_tokens == 0 for c in warm[1:])
    assert events_of(events, Chunk, first)[0].cached_tokens == 0


def test_request_id_is_the_gateways_from_extra_args_else_vllms_without_suffix(engine, attach, ledger):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    exporter = attach(ledger.url)
    plain = rid("plain")
    engine.core.add_request(plain, TokensPrompt(prompt_token_ids=prompt(20)), SamplingParams(max_tokens=2))
    gw = rid("gw")
    engine.core.add_request(
        "engine-side-id",
        TokensPrompt(prompt_token_ids=prompt(20)),
        SamplingParams(max_tokens=2, extra_args={"chunkledger_request_id": gw}),
    )
    engine.run()
    ids = {e.request_id for e in events_of(_events(ledger, exporter), Queued)}
    assert ids == {plain, gw}


def test_kv_pressure_preemptions_are_reported_with_resume_and_recomputed_tokens(engine, attach, ledger):
    exporter = attach(ledger.url)
    ids = [rid(f"kv{i}") for i in range(8)]
    for r in ids:  # 8 x (350 + 150) tokens against a 3072-token KV cache
        engine.add(r, prompt(350), max_tokens=150)
    outs = engine.run()
    events = _events(ledger, exporter)

    assert all(len(outs[r].outputs[0].token_ids) == 150 for r in ids)
    preempted = events_of(events, Preempted)
    assert preempted, "a 3072-token KV cache must preempt 4000 tokens of work"
    resumed = events_of(events, Resumed)
    assert len(resumed) == len(preempted)
    assert any(e.output_tokens > 0 for e in resumed)  # preempted while decoding
    for p in preempted:
        assert p.kv_blocks_freed > 0 and p.computed_tokens > 0 and p.reason == "kv_pressure"
        mine = [e for e in events if getattr(e, "request_id", None) == p.request_id and e.seq > p.seq]
        resume = next(e for e in mine if isinstance(e, Resumed))
        next_p = next((e for e in mine if isinstance(e, Preempted)), None)
        until = next_p.seq if next_p is not None else float("inf")
        again = [c for c in mine if isinstance(c, Chunk) and c.seq < until]
        assert all(c.preemptions >= 1 for c in again)
        # Every position it had ever computed (the high-water mark of its preemptions) comes back
        # from the prefix cache or is recomputed, up to where a second preemption stops the
        # recompute (under KV pressure a resumed request can be preempted again mid-recompute).
        hw = max(q.computed_tokens for q in preempted if q.request_id == p.request_id and q.seq <= p.seq)
        back = hw if next_p is None else min(hw, next_p.computed_tokens)
        assert resume.cached_tokens + sum(c.recomputed_tokens for c in again) == back
    for r in ids:
        chunks = events_of(events, Chunk, r)
        new = sum(c.tokens - c.recomputed_tokens for c in chunks)
        assert new >= 350  # every prompt token once (plus output positions never computed before)
        (fin,) = events_of(events, Finished, r)
        assert fin.output_tokens == 150
    stalled = [s for s in events_of(events, Step) if s.stalled_request_ids]
    for s in stalled:
        assert len(s.stalled_request_ids) == len(s.stalled_kv_blocks)
        assert not set(s.stalled_request_ids) & set(s.request_ids)


def test_decodes_on_the_fast_path_report_what_vllm_held_when_it_preempted_them(
    engine, attach, ledger, monkeypatch
):
    """A running decode is only counted per step (the reporter's fast path: nothing read from vLLM).
    When vLLM preempts one, the ``preempted`` event still carries the computed tokens and KV blocks
    vLLM held at that moment, and every step's counts are those of what vLLM scheduled."""
    from engine_hooks.vllm import compat

    exporter = attach(ledger.url)
    sch = engine.scheduler
    table = compat.block_lists(sch)
    assert table is not None and sch._cl_fast
    at_preemption: dict[str, list[tuple[int, int, bool]]] = {}
    scheduled: dict[int, tuple[int, int]] = {}  # step -> (tokens, requests) vLLM scheduled
    preempt, schedule = sch._preempt_request, sch.schedule

    def probe_preempt(request, *args, **kwargs):
        st = sch._cl_states[request.request_id]
        held = (request.num_computed_tokens, len(table.get(request.request_id) or ()), st.fast)
        at_preemption.setdefault(st.ext, []).append(held)
        return preempt(request, *args, **kwargs)

    def probe_schedule(*args, **kwargs):
        step = sch._cl_step
        output = schedule(*args, **kwargs)
        tokens = output.num_scheduled_tokens
        scheduled[step] = (sum(tokens.values()), len(tokens))
        return output

    monkeypatch.setattr(sch, "_preempt_request", probe_preempt)
    monkeypatch.setattr(sch, "schedule", probe_schedule)
    for _ in range(8):  # 8 x (350 + 150) tokens against a 3072-token KV cache
        engine.add(rid("fast"), prompt(350), max_tokens=150)
    engine.run()
    events = _events(ledger, exporter)

    preempted = events_of(events, Preempted)
    by_request: dict[str, list[tuple[int, int]]] = {}
    for p in preempted:
        by_request.setdefault(p.request_id, []).append((p.computed_tokens, p.kv_blocks_freed))
    assert by_request == {r: [(c, b) for c, b, _ in held] for r, held in at_preemption.items()}
    assert any(fast for held in at_preemption.values() for _, _, fast in held), "no decode took the fast path"
    steps = events_of(events, Step)
    assert steps
    for s in steps:
        tokens, n = scheduled[s.step]
        assert (s.prefill_tokens + s.decode_tokens, s.num_prefill_reqs + s.num_decode_reqs) == (tokens, n)
        assert len(s.request_ids) == n


def test_resumed_requests_are_reported_whichever_list_vllm_sends_them_in(engine, attach, ledger, monkeypatch):
    """vLLM's Model Runner V1 gets a resumed request among the cached ones (``resumed_req_ids``); V2
    (a switch in 0.32 and 0.33, the only runner in 0.34) among the new ones. The plugin reads neither
    list: each resumption is one ``resumed`` event in both shapes."""
    from vllm.v1.core.sched.output import CachedRequestData

    exporter = attach(ledger.url)
    sch = engine.scheduler
    schedule = sch.schedule
    out_of_running: set[str] = set()
    sent_as = {"new": 0, "cached": 0}

    def probe(*args, **kwargs):
        output = schedule(*args, **kwargs)
        new = {r.req_id for r in output.scheduled_new_reqs}
        cached = set(getattr(output.scheduled_cached_reqs, "resumed_req_ids", ()))
        sent_as["new"] += len(out_of_running & new)
        sent_as["cached"] += len(out_of_running & cached)
        out_of_running.difference_update(new | cached)
        out_of_running.update(output.preempted_req_ids)
        return output

    monkeypatch.setattr(sch, "schedule", probe)
    for _ in range(8):  # 8 x (350 + 150) tokens against a 3072-token KV cache
        engine.add(rid("shape"), prompt(350), max_tokens=150)
    engine.run()
    resumed = events_of(_events(ledger, exporter), Resumed)
    as_new = getattr(engine, "mrv2", False) or "resumed_req_ids" not in CachedRequestData.__dataclass_fields__
    shape, other = ("new", "cached") if as_new else ("cached", "new")
    assert resumed and sent_as[other] == 0, sent_as
    assert sent_as[shape] == len(resumed), (sent_as, len(resumed))


def test_with_step_tokens_the_output_tokens_ride_on_the_steps(engine, attach, ledger):
    exporter = attach(ledger.url)
    engine.scheduler.options = type(engine.scheduler.options)(step_tokens=True)
    r = rid("step-tokens")
    engine.add(r, prompt(1000), max_tokens=4)
    out = engine.run()[r]
    events = _events(ledger, exporter)
    assert not events_of(events, Tokens, r)
    steps = [s for s in events_of(events, Step) if r in s.request_ids]
    groups = [g for s in steps for g in s.token_groups() if g[0] == r]
    assert [(count, total) for _, count, total, _ in groups] == [(1, 1), (1, 2), (1, 3), (1, 4)]
    assert output_token_ids(events)[r] == list(out.outputs[0].token_ids)
    assert all(s.token_counts == [0] for s in steps[:7])  # partial prefills sample no token
    (finished,) = events_of(events, Finished, r)
    assert finished.output_tokens == 4


def test_tokens_are_coalesced_per_request(engine, attach, ledger):
    exporter = attach(ledger.url)
    engine.scheduler.options = type(engine.scheduler.options)(tokens_flush=5, tokens_flush_s=60.0)
    r = rid("coalesce")
    engine.add(r, prompt(10), max_tokens=23)
    out = engine.run()[r]
    events = _events(ledger, exporter)
    tokens = events_of(events, Tokens, r)
    assert [t.count for t in tokens] == [5, 5, 5, 5, 3]
    assert [t.total for t in tokens] == [5, 10, 15, 20, 23]
    assert all(t.first_ts <= t.ts for t in tokens)
    assert output_token_ids(events)[r] == list(out.outputs[0].token_ids)
    assert not [s for s in events if isinstance(s, Step) and s.token_counts]


def test_every_output_token_reaches_the_ledger_once_in_order_with_the_outputs_folded_off_the_engine_thread(
    engine, attach, ledger
):
    exporter = attach(ledger.url)
    sch = engine.scheduler
    sch.options = type(sch.options)(tokens_flush=5, tokens_flush_s=60.0)
    folded = sch._cl_folder.folded
    ids = [rid(f"fold{i}") for i in range(12)]
    for i, r in enumerate(ids):
        engine.add(r, prompt(20 + 10 * i), max_tokens=7 + 3 * i)
    outs = engine.run()
    events = _events(ledger, exporter)
    assert sch._cl_folder.folded > folded  # the steps' outputs went through the folder's queue
    tokens = output_token_ids(events)
    for r in ids:
        produced = list(outs[r].outputs[0].token_ids)
        assert tokens[r] == produced, r
        sent = events_of(events, Tokens, r)
        assert [t.total for t in sent] == [min(5 * (k + 1), len(produced)) for k in range(len(sent))]
        (finished,) = events_of(events, Finished, r)
        assert finished.output_tokens == len(produced)
        assert max(t.seq for t in sent) < finished.seq  # its tokens before its finish


def test_a_failing_hook_is_counted_and_the_engine_keeps_serving(engine, attach, ledger):
    attach(ledger.url)
    before = engine.scheduler.hook_errors

    def broken(*args):
        raise RuntimeError("boom")

    engine.scheduler._e_step = broken
    r = rid("broken")
    engine.add(r, prompt(50), max_tokens=5)
    out = engine.run()[r]
    assert len(out.outputs[0].token_ids) == 5
    assert engine.scheduler.hook_errors > before


def test_client_abort_is_reported_as_finished_abort(engine, attach, ledger):
    exporter = attach(ledger.url)
    r = rid("client-abort")
    engine.add(r, prompt(30), max_tokens=500)
    for _ in range(5):
        engine.step()
    engine.core.abort_request([r])
    engine.run()
    (fin,) = events_of(_events(ledger, exporter), Finished, r)
    assert fin.reason == "abort" and 0 < fin.output_tokens < 500


def test_ledger_unreachable_vllm_keeps_serving_and_spooled_events_arrive_later(engine, attach, ledger_server):
    import httpx

    ledger_server.stop()
    exporter = attach(ledger_server.url)
    ids = [rid("outage") for _ in range(3)]
    for r in ids:
        engine.add(r, prompt(40), max_tokens=12)
    outs = engine.run()
    assert all(len(outs[r].outputs[0].token_ids) == 12 for r in ids)
    assert wait_until(lambda: exporter.stats().spooled > 0, 10.0)
    assert exporter.stats().sent == 0

    ledger_server.start()
    assert wait_until(lambda: exporter.stats().spool_pending == 0 and exporter.stats().sent > 0, 30.0)
    for r in ids:
        # (a connection to the restarted server has been seen reset once, its first answers sent)
        with httpx.Client(transport=httpx.HTTPTransport(retries=3), timeout=5) as client:
            row = client.get(f"{ledger_server.url}/v1/requests/{r}").json()["request"]
        assert row["output_tokens"] == 12
        assert row["prompt_tokens"] == 40


def test_vllms_own_stamps_are_taken_when_vllm_logs_stats_else_the_plugins_clock():
    from types import SimpleNamespace

    from vllm.v1.engine import EngineCoreEvent, EngineCoreEventType

    from engine_hooks.vllm.scheduler import _vllm_stamp

    queued_kind, scheduled_kind = EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED
    queued = EngineCoreEvent.new_event(queued_kind, 100.0)
    assert _vllm_stamp(SimpleNamespace(events=[queued]), queued_kind, 100.00002) == 100.0
    assert _vllm_stamp(SimpleNamespace(events=[]), queued_kind, 100.00002) == 100.00002  # no stats
    assert _vllm_stamp(SimpleNamespace(events=[queued]), scheduled_kind, 100.5) == 100.5  # other kind
    assert _vllm_stamp(SimpleNamespace(events=[queued]), queued_kind, 200.0) == 200.0  # a stale stamp
    scheduled = EngineCoreEvent.new_event(scheduled_kind, 100.000003)  # vLLM reads its clock after ours
    assert _vllm_stamp(SimpleNamespace(events=[queued, scheduled]), scheduled_kind, 100.000001) == 100.000003


def test_first_waits_are_vllms_own_queue_times_when_vllm_logs_stats(engine, attach, ledger, monkeypatch):
    """vLLM's request_queue_time_seconds is its SCHEDULED stamp less its QUEUED stamp; the first
    chunk's wait_s is the same span, to the bit."""
    from vllm.v1.request import Request

    stamps: dict[str, dict[str, float]] = {}
    record = Request.record_event

    def recording(self, event_type, timestamp=None):
        record(self, event_type, timestamp)
        stamps.setdefault(self.request_id, {}).setdefault(event_type.name, self.events[-1].timestamp)

    monkeypatch.setattr(Request, "record_event", recording)
    monkeypatch.setattr(engine.scheduler, "log_stats", True)  # its stamps; its stats stay off:
    monkeypatch.setattr(engine.scheduler, "make_stats", lambda *args, **kwargs: None)
    exporter = attach(ledger.url)
    ids = [rid("waits") for _ in range(6)]
    for r in ids:  # 6 x 300 tokens on a 128-token budget: the later ones wait several steps
        engine.add(r, prompt(300), max_tokens=2)
    engine.run()
    events = _events(ledger, exporter)
    for r in ids:
        first = events_of(events, Chunk, r)[0]
        (s,) = [v for k, v in stamps.items() if k.startswith(r + "-")]
        assert first.wait_s == s["SCHEDULED"] - s["QUEUED"], r
    assert len({events_of(events, Chunk, r)[0].step for r in ids}) >= 3  # waits of several steps


def test_queued_carries_the_trace_vllm_received_unless_the_gateway_sent_it(engine, attach, ledger):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if not hasattr(engine.core, "add_request") or engine.__class__.__name__ != "Engine":
        pytest.skip("the synthetic engine builds its requests without trace headers")
    trace, span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    headers = {"traceparent": f"00-{trace}-{span}-01"}
    exporter = attach(ledger.url)
    plain, gw = rid("traced"), rid("traced-gw")
    engine.core.add_request(
        plain, TokensPrompt(prompt_token_ids=prompt(20)), SamplingParams(max_tokens=2), trace_headers=headers
    )
    engine.core.add_request(
        "engine-side-traced",
        TokensPrompt(prompt_token_ids=prompt(20)),
        SamplingParams(max_tokens=2, extra_args={"chunkledger_request_id": gw}),
        trace_headers=headers,
    )
    engine.run()
    queued = {e.request_id: e for e in events_of(_events(ledger, exporter), Queued)}
    assert (queued[plain].trace_id, queued[plain].parent_span_id) == (trace, span)
    assert (queued[gw].trace_id, queued[gw].parent_span_id) == (None, None)
