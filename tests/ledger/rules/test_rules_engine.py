"""The live rule engine: events in, decisions out, time rules on the ticker, bounded state."""

from __future__ import annotations

import pytest

from engine_hooks import events as ev
from engine_hooks.columnar import encode_batch
from ledger.columnar import decode_columns
from ledger.rules.engine import RuleEngine
from ledger.rules.paraphrase import paraphrase_detector
from ledger.rules.policy import ParaphraseLoopSettings, Policy, parse_policy
from tools.loop_corpus import paraphrase_loop_corpus

ENGINE = ev.Source(id="e0", kind="engine", model="m")
GATEWAY = ev.Source(id="g0", kind="gateway")
T0 = 1_800_000_000.0


class Hooks:
    def __init__(self):
        self.decisions, self.confirms, self.done, self.drops, self.starved = [], [], [], [], []
        self.joined = []

    def decided(self, ds):
        self.decisions += ds

    def confirmed(self, sid, cid, ts):
        self.confirms.append((sid, cid))

    def request_done(self, rid, sid, kind):
        self.done.append((rid, sid, kind))

    def gateway_joined(self, rid, sid):
        self.joined.append((rid, sid))

    def dropped(self, source, count, reason, ts):
        self.drops.append((source.id, count, reason))

    def starving(self, r, waited, now):
        self.starved.append((r.request_id, round(waited)))


class Clock:
    def __init__(self, t):
        self.t = t

    def __call__(self):
        return self.t


def make(policy: dict | None = None, **kw):
    hooks, clock = Hooks(), Clock(T0)
    pol = parse_policy(policy or {})
    eng = RuleEngine(lambda: pol, hooks, clock=clock, mono=clock, **kw)
    return eng, hooks, clock


def seqs(events, start=1):
    import msgspec

    return [msgspec.structs.replace(e, seq=start + i) for i, e in enumerate(events)]


def tokens(rid, total, count=16, ts=T0, ids=None):
    return ev.Tokens(seq=0, ts=ts, request_id=rid, count=count, total=total, token_ids=ids)


def test_token_cap_decides_abort_once_with_the_engine_as_target():
    eng, hooks, _ = make({"rules": {"max_output_tokens": 40}})
    eng.observe(ENGINE, seqs([ev.Queued(seq=0, ts=T0, request_id="r", prompt_tokens=5), tokens("r", 32)]), T0)
    assert hooks.decisions == []
    eng.observe(ENGINE, seqs([tokens("r", 48), tokens("r", 64)], 3), T0)
    assert [(d.rule, d.action, d.engine_source_id) for d in hooks.decisions] == [("token_cap", "abort", "e0")]
    assert hooks.decisions[0].detail == "64 output tokens, ledger cap 40"  # checked at the end of the batch


def test_a_request_that_finishes_in_the_same_batch_is_not_cut():
    eng, hooks, _ = make({"rules": {"max_output_tokens": 40}})
    eng.observe(
        ENGINE, seqs([tokens("r", 64), ev.Finished(seq=0, ts=T0, request_id="r", reason="length")]), T0
    )
    assert hooks.decisions == [] and eng.get("r") is None
    assert hooks.done == [("r", "e0", "finished")]


def test_loop_in_token_ids_is_cut_with_period_in_the_detail():
    eng, hooks, _ = make()
    ids = [101, 2023, 318] * 60
    eng.observe(
        ENGINE, seqs([tokens("r", (i + 1) * 18, 18, ids=ids[i * 18 : (i + 1) * 18]) for i in range(10)]), T0
    )
    assert [d.rule for d in hooks.decisions] == ["loop"]
    assert "period 3" in hooks.decisions[0].detail


def _counter_loop(n: int = 80) -> list[int]:
    """A block of 12 ids whose first id counts up: one token changed per repeat (960 ids)."""
    return [t for i in range(n) for t in (1000 + i, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17)]


def test_near_loop_is_cut_unless_the_policy_disables_it():
    ids = _counter_loop()
    batch = seqs([tokens("r", len(ids), len(ids), ids=ids)])
    eng, hooks, _ = make({"rules": {"near_loop": {"enabled": False}}})
    eng.observe(ENGINE, batch, T0)
    assert hooks.decisions == [] and eng.get("r").near_detector is None
    eng, hooks, _ = make()  # on by default
    eng.observe(ENGINE, batch, T0)
    assert [d.rule for d in hooks.decisions] == ["near_loop"]
    assert "period 12" in hooks.decisions[0].detail and "changed" in hooks.decisions[0].detail


def test_paraphrase_loop_is_cut_only_where_the_policy_enables_it():
    loop = paraphrase_loop_corpus()[0]
    ids = loop.tokens
    assert paraphrase_detector(ParaphraseLoopSettings()).extend(ids) is not None
    batch = seqs([tokens("r", len(ids), len(ids), ids=ids)])
    eng, hooks, _ = make()
    eng.observe(ENGINE, batch, T0)
    assert hooks.decisions == [] and eng.get("r").paraphrase_detector is None  # off by default
    eng, hooks, _ = make({"rules": {"paraphrase_loop": {"enabled": True}}})
    eng.observe(ENGINE, batch, T0)
    assert [d.rule for d in hooks.decisions] == ["paraphrase_loop"]
    assert "re-say phrases" in hooks.decisions[0].detail


def test_streaming_gateway_is_a_second_target_until_it_completes():
    eng, hooks, _ = make({"rules": {"max_output_tokens": 10}})
    eng.observe(GATEWAY, seqs([ev.Arrived(seq=0, ts=T0, request_id="r", stream=True)]), T0)
    eng.observe(ENGINE, seqs([tokens("r", 16)]), T0)
    assert hooks.decisions[0].gateway_source_id == "g0"
    eng.observe(GATEWAY, seqs([ev.Arrived(seq=0, ts=T0, request_id="q", stream=False)], 5), T0)
    eng.observe(ENGINE, seqs([tokens("q", 16)], 5), T0)
    assert hooks.decisions[1].gateway_source_id is None  # not streaming: nothing to cut at the gateway


def test_a_gateway_whose_events_come_after_the_decision_is_reported_as_joined():
    eng, hooks, _ = make({"rules": {"max_output_tokens": 10}})
    eng.observe(ENGINE, seqs([tokens("r", 16)]), T0)  # decided before the gateway's arrival is seen
    assert hooks.decisions[0].gateway_source_id is None and hooks.joined == []
    eng.observe(GATEWAY, seqs([ev.Arrived(seq=0, ts=T0, request_id="r", stream=True)]), T0)
    assert hooks.joined == [("r", "g0")]
    eng.observe(GATEWAY, seqs([ev.FirstByte(seq=0, ts=T0, request_id="r")], 2), T0)
    assert hooks.joined == [("r", "g0")]  # once
    eng.observe(ENGINE, seqs([tokens("q", 16)], 2), T0)
    eng.observe(GATEWAY, seqs([ev.Arrived(seq=0, ts=T0, request_id="q", stream=False)], 3), T0)
    eng.observe(GATEWAY, seqs([ev.Arrived(seq=0, ts=T0, request_id="n", stream=True)], 4), T0)
    assert hooks.joined == [("r", "g0")]  # not streaming (nothing to cut), or nothing decided on it


def test_stall_and_wall_clock_timeouts_fire_on_the_ticker():
    eng, _hooks, clock = make({"rules": {"stall_timeout_s": 10, "wall_clock_timeout_s": 100}})
    eng.observe(ENGINE, seqs([ev.Queued(seq=0, ts=T0, request_id="a", prompt_tokens=5), tokens("a", 16)]), T0)
    eng.observe(ENGINE, seqs([ev.Queued(seq=0, ts=T0, request_id="b", prompt_tokens=5)], 3), T0)
    clock.t = T0 + 9
    assert eng.tick() == []
    clock.t = T0 + 11
    assert [(d.request_id, d.rule) for d in eng.tick()] == [("a", "stall_timeout")]
    clock.t = T0 + 101  # b never ran (no stall), but it has been admitted too long
    assert [(d.request_id, d.rule) for d in eng.tick()] == [("b", "wall_clock_timeout")]
    assert eng.tick() == []  # once per request and rule


def test_source_clock_skew_does_not_make_time_rules_fire_early():
    eng, _hooks, clock = make({"rules": {"stall_timeout_s": 10}})
    ahead = T0 + 3600  # the engine's wall clock runs an hour ahead of the ledger's
    eng.observe(ENGINE, seqs([tokens("a", 16, ts=ahead)]), T0)
    clock.t = T0 + 5
    assert eng.tick() == []
    clock.t = T0 + 11
    assert [d.rule for d in eng.tick()] == ["stall_timeout"]
    behind_eng, _behind_hooks, behind_clock = make({"rules": {"stall_timeout_s": 10}})
    behind_eng.observe(ENGINE, seqs([tokens("a", 16, ts=T0 - 3600)]), T0)  # an hour behind
    behind_clock.t = T0 + 5
    assert behind_eng.tick() == []


def test_preemptions_and_forced_waits_move_a_request_to_the_slow_pool_then_promote():
    eng, hooks, clock = make(
        {"rules": {"max_preemptions": 2, "slow_pool_max_wait_s": 30, "stall_timeout_s": 0}}
    )
    evs = [ev.Queued(seq=0, ts=T0, request_id="r", prompt_tokens=5)]
    for _ in range(2):
        evs += [ev.Preempted(seq=0, ts=T0, request_id="r"), ev.Resumed(seq=0, ts=T0, request_id="r")]
    eng.observe(ENGINE, seqs(evs), T0)
    assert [(d.rule, d.action) for d in hooks.decisions] == [("preemption_limit", "slow_pool")]
    clock.t = T0 + 31
    assert [(d.rule, d.action) for d in eng.tick()] == [("slow_pool_starved", "promote")]

    eng2, hooks2, _ = make({"rules": {"max_forced_waits": 3, "preemption_action": "non_preemptible"}})
    eng2.observe(ENGINE, seqs([ev.Queued(seq=0, ts=T0, request_id="r", prompt_tokens=5)]), T0)
    steps = [
        ev.Step(seq=0, ts=T0, step=i, duration_s=0.01, stalled_request_ids=["r", "gone"]) for i in range(3)
    ]
    eng2.observe(ENGINE, seqs(steps, 2), T0)
    assert [(d.rule, d.action) for d in hooks2.decisions] == [("forced_wait_limit", "non_preemptible")]


def test_starvation_alert_once_per_request():
    eng, hooks, clock = make({"alerts": {"starvation_wait_s": 20}})
    eng.observe(ENGINE, seqs([ev.Queued(seq=0, ts=T0, request_id="r", prompt_tokens=5)]), T0)
    clock.t = T0 + 21
    eng.tick()
    eng.tick()
    assert hooks.starved == [("r", 21)]


def test_confirmations_and_drops_are_reported():
    eng, hooks, _ = make()
    eng.observe(
        ENGINE,
        seqs(
            [
                ev.CutoffApplied(seq=0, ts=T0, request_id="r", command_id="c1", action="abort", rule="loop"),
                ev.Dropped(seq=0, ts=T0, count=7, reason="spool_full"),
            ]
        ),
        T0,
    )
    eng.observe(GATEWAY, seqs([ev.StreamCut(seq=0, ts=T0, request_id="r", rule="loop", command_id="c1")]), T0)
    assert hooks.confirms == [("e0", "c1"), ("g0", "c1")]
    assert hooks.drops == [("e0", 7, "spool_full")]


def test_live_state_is_bounded_and_idle_requests_are_evicted():
    eng, _, clock = make(max_live=100, idle_evict_s=60)
    eng.observe(ENGINE, seqs([tokens(f"r{i}", 16) for i in range(250)]), T0)
    assert len(eng.live) == 100 and eng.get("r249") is not None and eng.get("r0") is None
    clock.t = T0 + 61
    eng.tick()
    assert len(eng.live) == 0
    eng.observe(
        ENGINE, seqs([tokens("x", 16), ev.Finished(seq=0, ts=T0, request_id="x", reason="stop")], 300)
    )
    eng.observe(GATEWAY, seqs([ev.Completed(seq=0, ts=T0, request_id="x")]))
    eng.observe(GATEWAY, seqs([ev.FirstByte(seq=0, ts=T0, request_id="x")], 2))  # late: not tracked again
    assert eng.get("x") is None


def test_loop_detector_uses_the_models_override():
    eng, hooks, _ = make({"models": {"m": {"rules": {"loop": {"enabled": False}}}}})
    eng.observe(ENGINE, seqs([tokens("r", 200, 200, ids=[1, 2] * 100)]), T0)
    assert hooks.decisions == [] and eng.get("r").detector is None


def test_live_counts_and_kv_stall_views():
    eng, _, clock = make()
    eng.observe(ENGINE, seqs([tokens("b", 16, ts=T0 - 5)]), T0 - 5)  # received 5 s before a's
    eng.observe(ENGINE, seqs([tokens("a", 16)], 2), T0)
    eng.observe(
        ENGINE, seqs([ev.Step(seq=0, ts=T0, step=1, duration_s=0.01, stalled_request_ids=["a"])], 3), T0
    )
    assert eng.live_counts() == {"m": 2}
    assert eng.kv_stalled_counts() == {"m": 1}
    clock.t = T0 + 2
    assert round(eng.kv_stall_max_s()["m"]) == 7


def test_policy_changes_apply_to_new_checks():
    hooks, clock = Hooks(), Clock(T0)
    box = {"p": Policy()}
    eng = RuleEngine(lambda: box["p"], hooks, clock=clock, mono=clock)
    eng.observe(ENGINE, seqs([tokens("r", 100)]), T0)
    assert hooks.decisions == []
    box["p"] = parse_policy({"rules": {"max_output_tokens": 50}})
    eng.observe(ENGINE, seqs([tokens("r", 116)], 2), T0)
    assert [d.rule for d in hooks.decisions] == ["token_cap"]


def _step(k: int, groups: dict[str, list[int]], totals: dict[str, int]) -> ev.Step:
    """Step ``k`` running the requests of ``groups``, each getting those output token ids."""
    return ev.Step(
        seq=0,
        ts=T0 + k * 0.03,
        step=k,
        duration_s=0.03,
        request_ids=list(groups),
        token_counts=[len(ids) for ids in groups.values()],
        token_totals=[totals[rid] for rid in groups],
        token_ids=[t for ids in groups.values() for t in ids],
    )


@pytest.mark.parametrize("wire", ["events", "columns"])
def test_tokens_carried_by_steps_feed_the_loop_detector_per_request_and_the_token_cap(wire):
    """From the steps' events, and from the columnar message they came in (grouped from its columns)."""
    eng, hooks, _ = make({"rules": {"max_output_tokens": 170}})
    loop = [101, 2023, 318] * 60
    rnd = [(i * 7919) % 5003 for i in range(180)]  # not periodic within the detector's window
    steps = []
    for k in range(180):
        groups = {"text": [rnd[k]], "idle": []}
        if k < 160:  # under the cap: only the loop can cut it
            groups["looping"] = [loop[k]]
        steps.append(_step(k, groups, {"looping": k + 1, "text": k + 1, "idle": 0}))
    events = seqs(steps)
    columns = None
    if wire == "columns":
        body = encode_batch(ev.Batch(source=ENGINE, events=events))
        columns = decode_columns(body, max_events=10**6)
        assert columns.batch().events == events
    eng.observe(ENGINE, events, T0, columns)
    decided = {(d.request_id, d.rule) for d in hooks.decisions}
    assert ("looping", "loop") in decided and ("text", "token_cap") in decided
    assert not any(rid == "text" and rule == "loop" for rid, rule in decided)
    assert eng.get("idle") is None  # a runner that got no token is not made live by the step
    assert eng.get("text").output_tokens == 180


def test_a_steps_tokens_for_a_request_finished_earlier_in_the_batch_are_ignored():
    eng, hooks, _ = make({"rules": {"max_output_tokens": 10}})
    queued = ev.Queued(seq=0, ts=T0, request_id="r", prompt_tokens=5)
    fin = ev.Finished(seq=0, ts=T0, request_id="r", reason="length", output_tokens=64)
    # the plugin sends a request's finish before the step that carries its last tokens
    eng.observe(ENGINE, seqs([queued, fin, _step(1, {"r": [5] * 64}, {"r": 64})]), T0)
    assert hooks.decisions == [] and eng.get("r") is None


def _counting_evaluate(monkeypatch) -> list[str]:
    from ledger.rules import rules as R

    seen: list[str] = []
    real = R.evaluate

    def counted(r, p, now, rules=R.ALL_RULES):
        seen.append(r.request_id)
        return real(r, p, now, rules)

    monkeypatch.setattr(R, "evaluate", counted)
    return seen


def test_the_ticker_looks_only_at_requests_whose_deadline_passed_or_whose_state_changed(monkeypatch):
    eng, _hooks, clock = make({"rules": {"stall_timeout_s": 10}, "alerts": {"starvation_wait_s": 60}})
    waiting = [ev.Queued(seq=0, ts=T0, request_id=f"w{i}", prompt_tokens=5) for i in range(1000)]
    eng.observe(ENGINE, seqs([*waiting, tokens("run", 16)]), T0)
    seen = _counting_evaluate(monkeypatch)
    assert eng.tick() == [] and len(seen) == 1001  # new: each looked at once
    seen.clear()
    clock.t = T0 + 5
    eng.observe(ENGINE, seqs([tokens("run", 32, ts=T0 + 5)], 1002), T0 + 5)
    seen.clear()  # (the event rules looked at it)
    assert eng.tick() == [] and seen == ["run"]  # only what an event changed
    seen.clear()
    clock.t = T0 + 14
    # none of the waiting ones; "run" once more, at the deadline it had before its last token
    assert eng.tick() == [] and seen == ["run"]
    seen.clear()
    clock.t = T0 + 16  # 11 s after its last token
    assert [(d.request_id, d.rule) for d in eng.tick()] == [("run", "stall_timeout")] and seen == ["run"]
    seen.clear()
    clock.t = T0 + 61  # the waiting ones pass the starvation deadline together
    eng.tick()
    assert len(seen) == 1000 and len(_hooks.starved) == 1000


def test_a_lower_limit_in_a_new_policy_reaches_requests_no_event_touched():
    hooks, clock = Hooks(), Clock(T0)
    box = {"p": parse_policy({"rules": {"wall_clock_timeout_s": 1000}})}
    eng = RuleEngine(lambda: box["p"], hooks, clock=clock, mono=clock)
    eng.observe(ENGINE, seqs([ev.Queued(seq=0, ts=T0, request_id="q", prompt_tokens=5)]), T0)
    clock.t = T0 + 50
    assert eng.tick() == []  # its deadline is T0 + 1000
    box["p"] = parse_policy({"rules": {"wall_clock_timeout_s": 30}})
    assert [(d.request_id, d.rule) for d in eng.tick()] == [("q", "wall_clock_timeout")]
