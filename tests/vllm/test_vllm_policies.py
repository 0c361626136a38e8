"""The plugin's optional scheduling policies: admission reserve, KV-idle victim, escape valve."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fake_ledger import FakeLedger
from vllm_helpers import events_of, prompt, rid, set_options

from engine_hooks.config import ConfigError
from engine_hooks.events import Chunk, Queued
from engine_hooks.vllm.options import LedgerOptions

pytestmark = pytest.mark.vllm


@pytest.fixture
def ledger():
    fake = FakeLedger()
    yield fake
    fake.stop()


def _first_chunk_steps(engine, attach, ledger, **options):
    """A 1800-token prompt, then a 40-token one two steps later: (steps the short one waited, the long
    one's chunk in the step the short one started, steps the long prefill went on after that)."""
    exporter = attach(ledger.url)
    set_options(engine, **options)
    long, short = rid("long"), rid("short")
    engine.add(long, prompt(1800), max_tokens=2)
    engine.step()
    engine.step()
    engine.add(short, prompt(40), max_tokens=2)
    engine.run()
    assert exporter.force_flush(10.0)
    events = list(ledger.store.events)
    long_chunks = {c.step: c for c in events_of(events, Chunk, long)}
    short_first = events_of(events, Chunk, short)[0]
    queued_at = min(long_chunks) + 2  # the short request arrived before the long one's third step
    beside = long_chunks.get(short_first.step)
    return short_first.step - queued_at, beside.tokens if beside else 0, max(long_chunks) - short_first.step


def test_without_reserve_a_long_prefill_holds_arrivals_until_it_ends(engine, attach, ledger):
    waited, _, left = _first_chunk_steps(engine, attach, ledger)
    assert waited >= 10 and left == 0  # admitted only in the long prefill's last step


def test_admission_reserve_admits_arrivals_during_a_long_prefill(engine, attach, ledger):
    waited, beside, left = _first_chunk_steps(engine, attach, ledger, admission_reserve=0.25)
    assert waited <= 1  # the next step
    assert beside <= 96  # the long chunk left a quarter of the 128-token budget
    assert left >= 8


def test_admission_reserve_admits_the_shortest_prompt_first(engine, attach, ledger):
    exporter = attach(ledger.url)
    set_options(engine, admission_reserve=0.25, admission_aging_s=60.0)
    long, mid, tiny = rid("long"), rid("mid"), rid("tiny")
    engine.add(long, prompt(1500), max_tokens=2)
    engine.step()
    engine.add(mid, prompt(100), max_tokens=2)
    engine.add(tiny, prompt(20), max_tokens=2)
    engine.run()
    assert exporter.force_flush(10.0)
    events = list(ledger.store.events)
    tiny_first, mid_first = events_of(events, Chunk, tiny)[0], events_of(events, Chunk, mid)[0]
    assert tiny_first.tokens == 20  # its whole prompt in the reserve
    assert (tiny_first.step, tiny_first.seq) < (mid_first.step, mid_first.seq)  # scheduled before mid


def test_admission_aging_bound_keeps_arrival_order_for_old_requests(engine, attach, ledger):
    exporter = attach(ledger.url)
    set_options(engine, admission_reserve=0.25, admission_aging_s=0.0)  # everyone is "old"
    long, mid, tiny = rid("long"), rid("mid"), rid("tiny")
    engine.add(long, prompt(1500), max_tokens=2)
    engine.step()
    engine.add(mid, prompt(100), max_tokens=2)
    engine.add(tiny, prompt(20), max_tokens=2)
    engine.run()
    assert exporter.force_flush(10.0)
    events = list(ledger.store.events)
    tiny_first, mid_first = events_of(events, Chunk, tiny)[0], events_of(events, Chunk, mid)[0]
    assert (mid_first.step, mid_first.seq) < (tiny_first.step, tiny_first.seq)  # arrival order
    assert len(events_of(events, Queued)) == 3


def test_admission_depth_cap_shrinks_deep_chunks(engine, attach, ledger):
    exporter = attach(ledger.url)
    set_options(engine, admission_reserve=0.25, admission_depth_tokens=1024, admission_min_chunk=16)
    long, other = rid("long"), rid("decoding")
    engine.add(other, prompt(10), max_tokens=1000)  # keeps a second request in the engine
    engine.add(long, prompt(1800), max_tokens=2)
    while long not in engine.finished:
        engine.step()
    engine.core.abort_request([other])
    engine.run()
    assert exporter.force_flush(10.0)
    chunks = events_of(list(ledger.store.events), Chunk, long)
    for c in chunks:
        assert c.tokens <= max(16, int(96 / (1 + c.computed_before / 1024)))
    assert chunks[0].tokens == 96 and chunks[-1].tokens < 48  # shallow chunks big, deep ones small


# -- victim choice, without running the engine ----------------------------------------------------


def _scheduler(options: LedgerOptions, marks: dict[str, dict]):
    from engine_hooks.vllm.scheduler import LedgerScheduler, _ReqState

    sch = LedgerScheduler.__new__(LedgerScheduler)
    sch.options = options
    sch.hook_errors = 0
    sch._cl_logged = set()
    sch._cl_states = {}
    for i, (name, attrs) in enumerate(marks.items()):
        st = _ReqState(name, 0, now=100.0)
        st.last_active = attrs.get("last_active", 100.0 + i)
        st.non_preemptible = attrs.get("non_preemptible", False)
        sch._cl_states[name] = st
    return sch


def _reqs(marks: dict[str, dict]) -> list:
    return [SimpleNamespace(request_id=n, num_preemptions=a.get("preemptions", 0)) for n, a in marks.items()]


def test_default_victim_is_the_last_unprotected_request_after_the_current_one():
    marks = {"a": {}, "b": {}, "c": {}, "d": {"non_preemptible": True}}
    sch = _scheduler(LedgerOptions(), marks)
    running = _reqs(marks)
    sch._cl_current = running[1]
    assert sch._cl_choose_victim(running).request_id == "c"  # d is protected, a was already scheduled


def test_kv_idle_victim_is_the_request_idle_longest():
    marks = {
        "a": {"last_active": 1.0},
        "cur": {},
        "b": {"last_active": 50.0},
        "c": {"last_active": 20.0},
        "d": {},
    }
    sch = _scheduler(LedgerOptions(kv_idle_victim=True), marks)
    running = _reqs(marks)
    sch._cl_current = running[1]
    assert sch._cl_choose_victim(running).request_id == "c"  # a is before the current request


def test_escape_valve_protects_requests_preempted_too_often():
    marks = {"cur": {}, "b": {}, "c": {"preemptions": 2}}
    sch = _scheduler(LedgerOptions(preempt_escape_after=2), marks)
    running = _reqs(marks)
    sch._cl_current = running[0]
    assert sch._cl_choose_victim(running).request_id == "b"
    marks = {"cur": {}, "b": {"non_preemptible": True}, "c": {"preemptions": 2}}
    sch = _scheduler(LedgerOptions(preempt_escape_after=2), marks)
    running = _reqs(marks)
    sch._cl_current = running[0]
    assert sch._cl_choose_victim(running) is running[0]  # everyone else protected: it yields itself


# -- option parsing --------------------------------------------------------------------------------


def test_options_are_off_by_default():
    opts = LedgerOptions.from_sources(environ={})
    assert not opts.reorders and opts.admission_reserve == 0 and not opts.kv_idle_victim


def test_options_come_from_env_and_additional_config_wins():
    env = {"CHUNKLEDGER_VLLM_ADMISSION_RESERVE": "0.2", "CHUNKLEDGER_VLLM_KV_IDLE_VICTIM": "yes"}
    opts = LedgerOptions.from_sources(environ=env, extra={"admission_reserve": 0.3})
    assert opts.admission_reserve == 0.3 and opts.kv_idle_victim and opts.reorders


@pytest.mark.parametrize(
    ("env", "extra", "named"),
    [
        ({"CHUNKLEDGER_VLLM_ADMISSION_RESERVE": "1.5"}, None, "CHUNKLEDGER_VLLM_ADMISSION_RESERVE"),
        ({"CHUNKLEDGER_VLLM_KV_IDLE_VICTIM": "maybe"}, None, "CHUNKLEDGER_VLLM_KV_IDLE_VICTIM"),
        ({}, {"tokens_flush": 0}, "additional_config.chunkledger.tokens_flush"),
        ({}, {"no_such_option": 1}, "additional_config.chunkledger.no_such_option"),
    ],
)
def test_bad_option_names_the_variable_or_key(env, extra, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        LedgerOptions.from_sources(environ=env, extra=extra)
