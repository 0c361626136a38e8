"""The plugin's optional scheduling policies: admission reserve, KV-idle victim, escape valve."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from engine_hooks.config import ConfigError
from engine_hooks.events import Chunk, Preempted, Queued, Step
from engine_hooks.vllm.options import LedgerOptions
from engine_hooks.vllm.predict import OutputLengths, StepTimes, attention_work
from tests.engine_hooks.vllm.vllm_helpers import BUDGET, events_of, prompt, rid, set_options
from tests.support.fake_ledger import FakeLedger

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


def test_admission_reserve_holds_back_only_what_waiting_requests_take(engine, attach, ledger):
    exporter = attach(ledger.url)
    set_options(engine, admission_reserve=0.25)
    long, short = rid("long"), rid("short")
    engine.add(long, prompt(1800), max_tokens=2)
    engine.step()
    engine.step()
    engine.add(short, prompt(20), max_tokens=3)
    engine.run()
    assert exporter.force_flush(10.0)
    events = list(ledger.store.events)
    long_chunks = {c.step: c.tokens for c in events_of(events, Chunk, long)}
    short_chunks = events_of(events, Chunk, short)
    first = short_chunks[0]
    assert first.tokens == 20  # the whole short prompt in one step
    assert long_chunks[first.step] == 128 - 20  # not 96: the reserve is what the short can take
    decoding = set(range(first.step + 1, first.step + 3))  # the short's two decode steps
    for step, tokens in sorted(long_chunks.items())[:-1]:  # (the last chunk is the prompt's rest)
        if step == first.step:
            continue
        assert tokens == (127 if step in decoding else 128), (step, tokens)


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
    assert chunks[0].tokens == 128 - 10  # depth 0, next to the other's 10-token prompt
    for c in chunks[1:-1]:  # the other decodes one token a step: the cap is 127 / (1 + depth / 1024)
        assert c.tokens == max(16, int(127 / (1 + c.computed_before / 1024))), c
    assert chunks[-1].tokens <= max(16, int(127 / (1 + chunks[-1].computed_before / 1024)))
    assert chunks[-1].tokens < 48  # deep chunks small


def test_depth_cap_is_off_while_nobody_else_can_run(engine, attach, ledger):
    exporter = attach(ledger.url)
    set_options(engine, admission_reserve=0.25, admission_depth_tokens=256)
    long = rid("long")
    engine.add(long, prompt(1800), max_tokens=2)
    engine.run()
    assert exporter.force_flush(10.0)
    chunks = events_of(list(ledger.store.events), Chunk, long)
    assert [c.tokens for c in chunks[:-1]] == [128] * (len(chunks) - 1)


def _long_beside_a_decode(engine, n_prompt: int) -> str:
    """Prefill a ``n_prompt`` prompt while another request decodes; its id."""
    long, other = rid("long"), rid("decoding")
    engine.add(other, prompt(10), max_tokens=1000)  # keeps a second request in the engine
    engine.add(long, prompt(n_prompt), max_tokens=2)
    while long not in engine.finished:
        engine.step()
    engine.core.abort_request([other])
    engine.run()
    return long


class _FixedStepTimes(StepTimes):
    """A step-time fit that stays as it was built: the engine's measured steps do not move it."""

    def add(self, tokens: int, work: float, seconds: float, depth: int = 0) -> None:
        pass


def _fixed_fit(a: float, b: float, c: float) -> StepTimes:
    """A fit of ``seconds = a + b * tokens + c * work`` (exact data through the real solver, whose
    ridge leaves ~1e-5 relative error)."""
    fit = _FixedStepTimes(decay=1.0, min_samples=1)
    for tokens in (1, 16, 64, 128, 200):
        for depth in (0, 300, 900, 1700):
            work = attention_work(tokens, depth)
            StepTimes.add(fit, tokens, work, a + b * tokens + c * work)
    coef = fit.coefficients()
    assert coef is not None and all(abs(x - y) <= 1e-4 * y for x, y in zip(coef[:3], (a, b, c), strict=True))
    assert coef[3] == 0.0  # no chunk depths fed
    return fit


def test_step_time_fit_learns_from_every_measured_step(engine, attach, ledger, monkeypatch):
    exporter = attach(ledger.url)
    sch = engine.scheduler
    monkeypatch.setattr(sch, "step_times", StepTimes(min_samples=8))
    sch.step_caps.clear()
    # A target no step reaches: the fit learns from the measured steps and the cap never binds.
    set_options(engine, admission_reserve=0.25, admission_step_target_s=60.0, admission_min_chunk=16)
    long = _long_beside_a_decode(engine, 1800)
    assert exporter.force_flush(10.0)
    events = list(ledger.store.events)
    steps = [s for s in events if isinstance(s, Step) and s.prefill_tokens + s.decode_tokens > 0]
    assert len(steps) >= 8 and sch.step_times.samples == len(steps)
    assert sch.step_times.coefficients() is not None and not sch.step_caps
    chunks = events_of(events, Chunk, long)
    assert [c.tokens for c in chunks[1:-1]] == [127] * (len(chunks) - 2)  # the reserve's cap only


def test_step_target_caps_deep_chunks_to_what_the_fit_predicts_fits(engine, attach, ledger, monkeypatch):
    exporter = attach(ledger.url)
    sch = engine.scheduler
    # Fixed, so the test does not hang on how fast this machine runs steps (the fit from measured
    # steps is the test above): 2 ms a step, 1 us a token, 0.1 us a unit of attention work.
    fit = _fixed_fit(2e-3, 1e-6, 1e-7)
    monkeypatch.setattr(sch, "step_times", fit)
    sch.step_caps.clear()
    decode = attention_work(1, 10, False)
    target = fit.predict(1 + 127, decode + attention_work(127, 400))  # a whole chunk up to depth 400
    assert target is not None
    set_options(engine, admission_reserve=0.25, admission_step_target_s=target, admission_min_chunk=16)
    long = _long_beside_a_decode(engine, 1800)
    assert exporter.force_flush(10.0)
    chunks = events_of(list(ledger.store.events), Chunk, long)[:-1]  # (the last is the prompt's rest)
    caps = {step: (depth, cap) for step, depth, cap in sch.step_caps}
    assert caps, "the step-time cap never bound"

    def allowed(depth: int, decode_depth: int) -> int:
        n = fit.max_chunk(target, 1, attention_work(1, decode_depth, False), depth)
        assert n is not None
        return min(127, max(16, n))

    for c in chunks[1:]:  # the other request decodes beside each chunk (its depth between 10 and 2048)
        assert allowed(c.computed_before, 2048) <= c.tokens <= allowed(c.computed_before, 10), c
        if c.step in caps:
            assert caps[c.step] == (c.computed_before, c.tokens), (c, caps[c.step])
        else:
            assert c.tokens == 127, c
    shallow = [c.tokens for c in chunks[1:] if c.computed_before <= 300]
    assert len(shallow) >= 2 and shallow == [127] * len(shallow)  # within the target whole
    deep = [c.tokens for c in chunks if c.computed_before >= 900]
    assert deep and max(deep) <= allowed(900, 10) < 127  # the cap binds deeper down
    tokens = [c.tokens for c in chunks[1:]]
    assert tokens == sorted(tokens, reverse=True) and tokens[-1] < deep[0]  # smaller the deeper


def test_step_target_caps_a_prefill_running_alone(engine, attach, ledger, monkeypatch):
    # vLLM ignores long_prefill_token_threshold for a lone request; a request arriving during the
    # step still waits for it, so the step target caps the lone prefill through the token budget.
    exporter = attach(ledger.url)
    sch = engine.scheduler
    fit = _fixed_fit(2e-3, 1e-6, 1e-7)
    monkeypatch.setattr(sch, "step_times", fit)
    sch.step_caps.clear()
    target = fit.predict(128, attention_work(128, 400))  # a whole chunk up to depth 400
    assert target is not None
    set_options(engine, admission_reserve=0.25, admission_step_target_s=target, admission_min_chunk=16)
    long = rid("long")
    engine.add(long, prompt(1800), max_tokens=2)
    engine.run()
    assert exporter.force_flush(10.0)
    chunks = events_of(list(ledger.store.events), Chunk, long)[:-1]
    assert sch.max_num_scheduled_tokens == BUDGET  # the budget is restored after every step
    for c in chunks:
        n = fit.max_chunk(target, 0, 0.0, c.computed_before)
        assert n is not None
        assert c.tokens == min(BUDGET, max(16, n)), c
    assert [c.tokens for c in chunks if c.computed_before <= 300] == [128] * 3
    assert max(c.tokens for c in chunks if c.computed_before >= 900) < 128


def test_step_target_never_splits_a_short_prompt_running_beside_the_long_one(
    engine, attach, ledger, monkeypatch
):
    exporter = attach(ledger.url)
    sch = engine.scheduler
    fit = _fixed_fit(2e-3, 1e-6, 1e-7)
    monkeypatch.setattr(sch, "step_times", fit)
    target = fit.predict(40, attention_work(40, 1200))  # deep down, a 40-token chunk at most
    assert target is not None
    set_options(engine, admission_reserve=0.25, admission_step_target_s=target, admission_min_chunk=16)
    long, short = rid("long"), rid("short")
    engine.add(long, prompt(1800), max_tokens=2)
    while True:
        engine.step()
        st = next(r for k, r in sch.requests.items() if k.startswith(long))
        if st.num_computed_tokens >= 1400:
            break
    engine.add(short, prompt(60), max_tokens=2)
    engine.run()
    assert exporter.force_flush(10.0)
    events = list(ledger.store.events)
    (first,) = [c for c in events_of(events, Chunk, short) if c.computed_before == 0]
    assert first.tokens == 60  # whole, though the cap at that depth is under 60
    beside = {c.step: c.tokens for c in events_of(events, Chunk, long)}
    assert beside[first.step] == 60  # the long prompt's chunk in that step is no smaller than the short


def test_arrivals_first_leaves_the_long_prefill_out_of_the_arrivals_first_step(engine, attach, ledger):
    exporter = attach(ledger.url)
    sch = engine.scheduler
    set_options(engine, admission_reserve=0.25, admission_arrivals_first=True)
    long = rid("long")
    engine.add(long, prompt(1800), max_tokens=2)
    for _ in range(3):
        engine.step()
    shorts = [rid("short") for _ in range(3)]
    held = sch.arrival_steps
    for s in shorts:
        engine.add(s, prompt(30), max_tokens=4)
    engine.run()
    assert exporter.force_flush(10.0)
    events = list(ledger.store.events)
    long_steps = {c.step for c in events_of(events, Chunk, long)}
    firsts = {c.step for s in shorts for c in events_of(events, Chunk, s) if c.computed_before == 0}
    assert len(firsts) == 1 and not firsts & long_steps  # the arrivals' step ran without the long chunk
    (first,) = firsts
    assert first + 1 in long_steps  # ... and the long prefill went on in the next step
    assert sch.arrival_steps == held + 1
    steps = {s.step: s for s in events if isinstance(s, Step)}
    assert long in {r for r in steps[first].stalled_request_ids}  # reported as sitting the step out
    assert sch.running == [] and sch._cl_held is None  # nothing left out of vLLM's queues
    ends = max(long_steps)
    gaps = [b - a for a, b in itertools.pairwise(sorted(long_steps))]
    assert max(gaps) <= 2, (gaps, ends)  # never two steps in a row without it


def test_step_target_is_off_until_the_fit_has_data(engine, attach, ledger, monkeypatch):
    exporter = attach(ledger.url)
    sch = engine.scheduler
    monkeypatch.setattr(sch, "step_times", StepTimes(min_samples=10_000))  # never enough
    sch.step_caps.clear()
    set_options(engine, admission_reserve=0.25, admission_step_target_s=1e-9, admission_min_chunk=16)
    long = _long_beside_a_decode(engine, 1000)
    assert exporter.force_flush(10.0)
    chunks = events_of(list(ledger.store.events), Chunk, long)
    assert [c.tokens for c in chunks[1:-1]] == [127] * (len(chunks) - 2) and not sch.step_caps


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


def test_step_target_needs_the_reserve_and_names_the_option():
    with pytest.raises(ConfigError, match=r"additional_config\.chunkledger\.admission_step_target_s"):
        LedgerOptions.from_sources(environ={}, extra={"admission_step_target_s": -1})
    with pytest.raises(ConfigError, match="CHUNKLEDGER_VLLM_ADMISSION_STEP_TARGET_S"):
        LedgerOptions.from_sources(environ={"CHUNKLEDGER_VLLM_ADMISSION_STEP_TARGET_S": "soon"})
    with pytest.raises(ConfigError, match=r"admission_step_target_s: works with the admission reserve"):
        LedgerOptions.from_sources(environ={}, extra={"admission_step_target_s": 0.2})
    opts = LedgerOptions.from_sources(
        environ={"CHUNKLEDGER_VLLM_ADMISSION_STEP_TARGET_S": "0.2"}, extra={"admission_reserve": 0.25}
    )
    assert opts.admission_step_target_s == 0.2 and LedgerOptions().admission_step_target_s == 0


def test_step_time_fit_recovers_a_linear_cost_and_solves_for_the_chunk():
    import random

    fit = StepTimes(min_samples=8)
    rng = random.Random(3)
    for i in range(40):
        if i == 7:
            assert fit.coefficients() is None and fit.max_chunk(0.2, 1, 0.0, 0) is None
        tokens, depth = rng.randint(1, 2048), rng.randint(0, 8000)
        work = attention_work(tokens, depth)
        fit.add(tokens, work, 0.002 + 1e-5 * tokens + 2e-8 * work)
    a, b, c, e = fit.coefficients()
    assert a == pytest.approx(0.002, rel=1e-4) and b == pytest.approx(1e-5, rel=1e-4) and e == 0.0
    assert c == pytest.approx(2e-8, rel=1e-4)
    others, others_work = 30, attention_work(30, 0)
    n = fit.max_chunk(0.2, others, others_work, 6000)
    assert 0 < n < 2048
    assert fit.predict(others + n, others_work + attention_work(n, 6000)) <= 0.2
    assert fit.predict(others + n + 1, others_work + attention_work(n + 1, 6000)) > 0.2
    assert fit.max_chunk(0.2, others, others_work, 12000) < n  # deeper: smaller
    assert fit.max_chunk(0.001, others, others_work, 0) == 0  # even the rest is over the target


def test_step_time_fit_learns_what_a_chunk_pays_for_its_depth_and_caps_small_deep_chunks_by_it():
    import random

    # 5 ms a step, 40 us a token, 50 ns a unit of attention work, and 1 us per token of chunk depth (a
    # 16-token chunk at depth 10k pays 10 ms reading its prefix, on top of its attention)
    def cost(tokens: int, work: float, depth: int) -> float:
        return 0.005 + 4e-5 * tokens + 5e-8 * work + 1e-6 * depth

    with_depth, without = StepTimes(decay=1.0), StepTimes(decay=1.0)
    rng = random.Random(5)
    for _ in range(300):
        n, depth = rng.choice((16, 32, 64, 256)), rng.randint(0, 12000)
        decodes = rng.randint(0, 8)
        work = attention_work(n, depth) + decodes * 100.0
        with_depth.add(n + decodes, work, cost(n + decodes, work, depth), depth)
        without.add(n + decodes, work, cost(n + decodes, work, depth))
    a, b, c, e = with_depth.coefficients()
    assert (a, b, c, e) == pytest.approx((0.005, 4e-5, 5e-8, 1e-6), rel=1e-3)
    target = 0.030
    n = with_depth.max_chunk(target, 0, 0.0, 10000)
    assert n is not None and 0 < n < 64
    assert (
        cost(n, attention_work(n, 10000), 10000) <= target < cost(n + 1, attention_work(n + 1, 10000), 10000)
    )
    blind = without.max_chunk(target, 0, 0.0, 10000)  # a fit without the term lets the chunk overrun
    assert blind is not None and cost(blind, attention_work(blind, 10000), 10000) > target * 1.05


def test_step_time_fit_keeps_costs_non_negative_and_forgets_old_steps():

    fit = StepTimes(decay=0.9, min_samples=4)
    for i in range(30):  # more work, less time: no negative cost is fitted
        fit.add(100 + i, 1e6 * (30 - i), 0.01 + 0.001 * i)
    assert all(x >= 0 for x in fit.coefficients())
    for _ in range(200):  # the machine got 10x slower: the fit follows
        for tokens in (10, 1000):
            fit.add(tokens, 0.0, 0.1 + 1e-3 * tokens)
    assert fit.predict(500, 0.0) == pytest.approx(0.6, rel=0.01)


def test_bad_escape_mode_names_the_option():
    with pytest.raises(ConfigError, match=r"additional_config\.chunkledger\.preempt_escape_for"):
        LedgerOptions.from_sources(environ={}, extra={"preempt_escape_for": "forever"})
    with pytest.raises(ConfigError, match="CHUNKLEDGER_VLLM_PREEMPT_ESCAPE_FOR"):
        LedgerOptions.from_sources(environ={"CHUNKLEDGER_VLLM_PREEMPT_ESCAPE_FOR": "never"})
    env = {"CHUNKLEDGER_VLLM_PREEMPT_ESCAPE_FOR": "predicted"}
    assert LedgerOptions.from_sources(environ=env).preempt_escape_for == "predicted"
    assert LedgerOptions().preempt_escape_for == "finish"


# -- the reserve's demand walk, on a stand-in scheduler ------------------------------------------------


def _req(name: str, *, prompt: int, computed: int = 0, output: int = 0) -> SimpleNamespace:
    total = prompt + output
    return SimpleNamespace(
        request_id=name,
        num_tokens=total,
        num_tokens_with_spec=total,
        num_output_placeholders=0,
        num_computed_tokens=computed,
        is_prefill_chunk=computed < total and computed < prompt,
    )


def _demand_scheduler(running, waiting, *, free_blocks=1000, max_seqs=16):
    from engine_hooks.vllm.scheduler import LedgerScheduler

    sch = LedgerScheduler.__new__(LedgerScheduler)
    sch.running = running
    sch.waiting = waiting
    sch.kv_holding_waiting = []
    sch.max_num_scheduled_tokens = 2048
    sch.max_num_running_reqs = sch.max_num_active_reqs = max_seqs
    sch.num_waiting_for_streaming_input = 0
    sch.block_size = 16
    pool = SimpleNamespace(get_num_free_blocks=lambda: free_blocks)
    sch.kv_cache_manager = SimpleNamespace(block_pool=pool)
    return sch


def test_reserve_demand_counts_what_others_can_take():
    long = _req("long", prompt=8000, computed=4000)
    decode = _req("dec", prompt=40, computed=40, output=1)  # needs one token
    shorts = [_req("s1", prompt=30), _req("s2", prompt=50)]
    sch = _demand_scheduler([long, decode], shorts)
    assert sch._cl_others_demand(512) == (1 + 30 + 50, 4000)  # the long prefill itself is not counted
    assert sch._cl_others_demand(60) == (60, 4000)  # at most the reserve
    sch = _demand_scheduler([long], [])
    assert sch._cl_others_demand(512) == (0, 4000)  # nobody else: no reserve
    sch = _demand_scheduler([decode], [_req("s", prompt=30), _req("long", prompt=8000)])
    assert sch._cl_others_demand(512) == (1 + 30, -1)  # the largest prefill may still be waiting


def test_reserve_demand_skips_waiting_requests_that_cannot_be_admitted():
    long = _req("long", prompt=8000, computed=4000)
    shorts = [_req("s1", prompt=30), _req("s2", prompt=50)]
    sch = _demand_scheduler([long], shorts, max_seqs=2)  # one free slot
    assert sch._cl_others_demand(512)[0] == 30
    sch = _demand_scheduler([long], shorts, max_seqs=1)  # no free slot
    assert sch._cl_others_demand(512)[0] == 0
    # 130 free blocks of 16 = 2080 tokens: the long chunk (2048) leaves 32: s1 fits, s2 does not.
    sch = _demand_scheduler([long], shorts, free_blocks=130)
    assert sch._cl_others_demand(512)[0] == 30
    # vLLM stops at the first waiting request that does not fit: so does the walk.
    sch = _demand_scheduler([long], [_req("s2", prompt=50), _req("s1", prompt=30)], free_blocks=130)
    assert sch._cl_others_demand(512)[0] == 0


# -- the escape valve's predictor ------------------------------------------------------------------


def test_output_length_predictor_is_the_conditional_p90_bounded_by_max_tokens():
    lengths = OutputLengths(window=100, quantile=0.9, min_samples=8)
    for n in range(10, 110, 10):  # 10, 20, ..., 100
        lengths.add(n)
    assert lengths.remaining(0, 1000) == 90  # p90 of all ten lengths is 90
    assert lengths.remaining(55, 1000) == 100 - 55  # of those longer than 55 (60..100): 100
    assert lengths.remaining(55, 80) == 80 - 55  # never past its max_tokens
    assert lengths.remaining(100, 1000) == 1  # longer than anything seen: no protection but progress
    few = OutputLengths(min_samples=8)
    for n in (5, 6, 7):
        few.add(n)
    assert few.remaining(3, 500) == 497  # too little history: until it finishes


def test_output_length_predictor_forgets_the_oldest():
    lengths = OutputLengths(window=8, quantile=1.0, min_samples=8)
    for _ in range(8):
        lengths.add(1000)
    assert lengths.remaining(0, 5000) == 1000
    for _ in range(8):
        lengths.add(10)
    assert len(lengths) == 8 and lengths.remaining(0, 5000) == 10


# -- the escape valve's "predicted" mode -----------------------------------------------------------


def test_predicted_escape_protects_only_while_granted():
    marks = {"cur": {}, "b": {"preemptions": 3}, "c": {"preemptions": 3}}
    sch = _scheduler(LedgerOptions(preempt_escape_after=2, preempt_escape_for="predicted"), marks)
    running = _reqs(marks)
    sch._cl_current = running[0]
    sch._cl_states["b"].escape_until = 50  # granted; c's protection has lapsed (None)
    assert sch._cl_choose_victim(running).request_id == "c"
    sch._cl_states["b"].escape_until = None
    assert sch._cl_choose_victim(running).request_id == "c"  # the last one again, b is not protected
    sch._cl_states["c"].escape_until = 80
    assert sch._cl_choose_victim(running).request_id == "b"


def test_lapsed_escape_goes_back_to_the_end_of_the_running_queue():
    marks = {"a": {}, "b": {}, "c": {}}
    sch = _scheduler(LedgerOptions(preempt_escape_after=1, preempt_escape_for="predicted"), marks)
    sch._cl_marked = 0
    sch.escape_lapses = 0
    running = [
        SimpleNamespace(request_id=n, num_preemptions=1, num_output_tokens=out)
        for n, out in (("a", 40), ("b", 10), ("c", 5))
    ]
    sch.running = list(running)
    sch._cl_states["a"].escape_until = 40  # reached: lapses now
    sch._cl_states["c"].escape_until = 30  # still protected
    sch._cl_reorder()
    assert [r.request_id for r in sch.running] == ["c", "b", "a"]
    assert sch._cl_states["a"].escape_until is None and sch.escape_lapses == 1


def _escape_run(engine, attach, ledger, after: int) -> tuple[list, dict[str, int]]:
    """History: ten finished 30-token requests; then 12 x (300 prompt + 250 output) tokens against
    the 3072-token KV cache, with the escape valve in "predicted" mode after ``after`` preemptions.
    Returns the grants and every request's preemptions. Checks, step by step, that a request under
    protection is preempted only in a step where every running request was protected."""
    exporter = attach(ledger.url)
    sch = engine.scheduler
    sch.output_lengths = OutputLengths()
    sch.escape_grants.clear()
    sch.escape_lapses = 0
    for _ in range(10):
        engine.add(rid("hist"), prompt(20), max_tokens=30)
    engine.run()
    assert len(sch.output_lengths) == 10
    set_options(engine, preempt_escape_after=after, preempt_escape_for="predicted")
    ids = [rid(f"kv{i}") for i in range(12)]
    for r in ids:
        engine.add(r, prompt(300), max_tokens=250)

    def protected(req) -> bool:
        st = sch._cl_states[req.request_id]
        return st.escape_until is not None and req.num_output_tokens < st.escape_until

    steps = 0
    while engine.core.has_unfinished_requests():
        before = {req.request_id: (req.num_preemptions, protected(req)) for req in sch.running}
        engine.step()
        for req in sch.waiting:
            n, was_protected = before.get(req.request_id, (req.num_preemptions, False))
            if req.num_preemptions > n and was_protected:
                assert all(p for _, p in before.values()), "preempted under protection"
        steps += 1
        assert steps < 20_000
    outs = engine.finished
    assert all(len(outs[r].outputs[0].token_ids) == 250 for r in ids)
    assert exporter.force_flush(10.0)
    preempted: dict[str, int] = {}
    for p in events_of(list(ledger.store.events), Preempted):
        preempted[p.request_id] = preempted.get(p.request_id, 0) + 1
    return list(sch.escape_grants), preempted


def test_predicted_escape_protects_for_the_predicted_length_then_lapses(engine, attach, ledger):
    grants, preempted = _escape_run(engine, attach, ledger, after=1)
    assert grants, "the workload must preempt someone"
    for g in grants:
        # Predicted from the history (30-token requests, then 250-token ones once two have finished):
        # to 30 tokens, or one more token past anything seen; or to its max_tokens.
        assert g.until in (max(30, g.output_tokens + 1), 250), g
    assert engine.scheduler.escape_lapses >= 1
    by_request: dict[str, list] = {}
    for g in grants:
        by_request.setdefault(g.request_id, []).append(g)
    lapsed_then_preempted = sum(
        later.output_tokens >= earlier.until
        for mine in by_request.values()
        for earlier, later in itertools.pairwise(mine)
    )
    assert lapsed_then_preempted >= 1  # its protection ran out and it was a victim again
    assert sum(len(m) for m in by_request.values()) == sum(preempted.get(r, 0) for r in by_request)


def test_predicted_escape_waits_for_n_preemptions(engine, attach, ledger):
    grants, preempted = _escape_run(engine, attach, ledger, after=2)
    assert any(n == 1 for n in preempted.values())  # preempted once: not protected
    assert grants
    for g in grants:
        assert g.preemptions % 2 == 0  # after 2 preemptions, and after 2 more once it lapsed
        assert preempted[g.request_id] >= g.preemptions
