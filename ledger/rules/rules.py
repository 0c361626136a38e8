"""Runaway rules: pure functions of one request's live state, the policy and the time.

Each rule returns a ``Verdict`` (rule name, action, human-readable detail) or None. The rule engine
(``ledger.rules.engine``) keeps the live state and calls them; tests call them directly with
hand-built states (table-driven). Times are ledger wall-clock seconds: the engine converts every source
timestamp with that source's measured clock offset before it lands in the state, so a rule never
subtracts timestamps of two different clocks.

Rules and their actions:

=====================  ==================================================================  ==========
rule                   fires when                                                          action
=====================  ==================================================================  ==========
``token_cap``          more output tokens than ``max_output_tokens``                       abort
``loop``               the loop detector found a repeated tail (see ``ledger.rules.loop``) abort
``near_loop``          a tail repeating a block with one token changed per repeat          abort
``paraphrase_loop``    the recent output re-says, re-worded, what it said before (off)     abort
``wall_clock_timeout`` admitted longer ago than ``wall_clock_timeout_s`` and not drained    abort
``stall_timeout``      running, and no new token (nor prefill progress) for ``stall_...``  abort
``preemption_limit``   preempted ``max_preemptions`` times                                 policy's
``forced_wait_limit``  sat out ``max_forced_waits`` steps while holding KV                 policy's
``slow_pool_starved``  in the slow pool with no progress for ``slow_pool_max_wait_s``      promote
=====================  ==================================================================  ==========
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ledger.rules.loop import LoopDetector
from ledger.rules.paraphrase import ParaphraseDetector
from ledger.rules.policy import RuleSettings


@dataclass(frozen=True)
class Verdict:
    rule: str
    action: str  # abort | slow_pool | non_preemptible | promote
    detail: str


@dataclass(eq=False)
class LiveRequest:
    """What the rules need to know about one request that has not finished (ledger clock)."""

    request_id: str
    model: str | None = None
    engine_source_id: str | None = None
    gateway_source_id: str | None = None
    gateway_streaming: bool = False  # a gateway is streaming it to a client (and can cut the stream)
    admitted_ts: float | None = None  # gateway admitted it (else the engine queued it)
    waiting_since: float | None = None  # queued or preempted and not (re)scheduled since; None: running
    running: bool = False  # scheduled at least once and not preempted since
    last_progress_ts: float | None = None  # newest token, chunk or resume
    output_tokens: int = 0
    preemptions: int = 0
    forced_waits: int = 0  # steps it sat out while holding KV blocks
    slow_pool_ts: float | None = None  # when the slow_pool command was decided
    finished: bool = False  # the engine finished it (or the gateway completed it)
    detector: LoopDetector | None = None
    near_detector: LoopDetector | None = None  # only when the near_loop rule is on
    paraphrase_detector: ParaphraseDetector | None = None  # only when the paraphrase_loop rule is on
    decided: set[str] = field(default_factory=set)  # rules and actions already decided (once each)
    starvation_alerted: bool = False
    touched_mono: float = 0.0  # ledger monotonic time of its newest event (eviction)
    # The deadline of its entry in the ticker's heap (``next_deadline`` when last computed; inf: none).
    scheduled: float = math.inf


def token_cap(r: LiveRequest, p: RuleSettings, now: float) -> Verdict | None:
    cap = p.max_output_tokens
    if cap is not None and r.output_tokens > cap:
        return Verdict("token_cap", "abort", f"{r.output_tokens} output tokens, ledger cap {cap}")
    return None


def loop(r: LiveRequest, p: RuleSettings, now: float) -> Verdict | None:
    hit = r.detector.hit if r.detector is not None else None
    if hit is None or not p.loop.enabled:
        return None
    return Verdict(
        "loop",
        "abort",
        f"period {hit.period} repeated {hit.repeats} times ({hit.span} tokens) at output token {hit.at}",
    )


def near_loop(r: LiveRequest, p: RuleSettings, now: float) -> Verdict | None:
    hit = r.near_detector.hit if r.near_detector is not None else None
    if hit is None or not p.near_loop.enabled:
        return None
    return Verdict(
        "near_loop",
        "abort",
        f"period {hit.period} repeated {hit.repeats} times ({hit.span} tokens, {hit.changes} changed)"
        f" at output token {hit.at}",
    )


def paraphrase_loop(r: LiveRequest, p: RuleSettings, now: float) -> Verdict | None:
    hit = r.paraphrase_detector.hit if r.paraphrase_detector is not None else None
    if hit is None or not p.paraphrase_loop.enabled:
        return None
    return Verdict(
        "paraphrase_loop",
        "abort",
        f"{hit.recurrent} of the last {hit.window} tokens re-say phrases said before ({hit.jumps} jumps,"
        f" {hit.vocabulary} distinct tokens) at output token {hit.at}",
    )


# Each time rule fires once the time passes its deadline: a function of the request's state and the
# policy, None while it cannot fire. The ticker visits a request again only when the earliest of them
# has passed or an event changed its state (``next_deadline``).


def wall_clock_deadline(r: LiveRequest, p: RuleSettings) -> float | None:
    limit = p.wall_clock_timeout_s
    return None if limit is None or r.admitted_ts is None else r.admitted_ts + limit


def wall_clock_timeout(r: LiveRequest, p: RuleSettings, now: float) -> Verdict | None:
    deadline = wall_clock_deadline(r, p)
    if deadline is not None and now > deadline:
        age, limit = now - r.admitted_ts, p.wall_clock_timeout_s  # type: ignore[operator]
        return Verdict("wall_clock_timeout", "abort", f"{age:.1f} s since admission, limit {limit:g} s")
    return None


def stall_deadline(r: LiveRequest, p: RuleSettings) -> float | None:
    limit = p.stall_timeout_s
    if limit is None or not r.running or r.last_progress_ts is None:
        return None
    return r.last_progress_ts + limit


def stall_timeout(r: LiveRequest, p: RuleSettings, now: float) -> Verdict | None:
    deadline = stall_deadline(r, p)
    if deadline is not None and now > deadline:
        idle, limit = now - r.last_progress_ts, p.stall_timeout_s  # type: ignore[operator]
        return Verdict(
            "stall_timeout", "abort", f"no new token for {idle:.1f} s while running, limit {limit:g} s"
        )
    return None


def preemption_limit(r: LiveRequest, p: RuleSettings, now: float) -> Verdict | None:
    n = p.max_preemptions
    if n is not None and r.preemptions >= n:
        return Verdict("preemption_limit", p.preemption_action, f"preempted {r.preemptions} times, limit {n}")
    return None


def forced_wait_limit(r: LiveRequest, p: RuleSettings, now: float) -> Verdict | None:
    n = p.max_forced_waits
    if n is not None and r.forced_waits >= n:
        return Verdict(
            "forced_wait_limit", p.preemption_action, f"sat out {r.forced_waits} steps holding KV, limit {n}"
        )
    return None


def slow_pool_deadline(r: LiveRequest, p: RuleSettings) -> float | None:
    limit = p.slow_pool_max_wait_s
    if limit is None or r.slow_pool_ts is None:
        return None
    return max(r.slow_pool_ts, r.last_progress_ts or 0.0) + limit


def slow_pool_starved(r: LiveRequest, p: RuleSettings, now: float) -> Verdict | None:
    deadline = slow_pool_deadline(r, p)
    if deadline is not None and now > deadline:
        limit = p.slow_pool_max_wait_s
        starved = now - deadline + limit  # type: ignore[operator]
        return Verdict(
            "slow_pool_starved",
            "promote",
            f"no progress for {starved:.1f} s in the slow pool, limit {limit:g} s",
        )
    return None


Rule = Callable[[LiveRequest, RuleSettings, float], Verdict | None]

# Checked when a request's events arrive (cheap, counters only) and on the ticker (time-based).
EVENT_RULES: tuple[Rule, ...] = (
    token_cap,
    loop,
    near_loop,
    paraphrase_loop,
    preemption_limit,
    forced_wait_limit,
)
TIME_RULES: tuple[Rule, ...] = (wall_clock_timeout, stall_timeout, slow_pool_starved)
ALL_RULES = EVENT_RULES + TIME_RULES
RULE_NAMES = tuple(f.__name__ for f in ALL_RULES)
_DEADLINES = (
    (wall_clock_timeout.__name__, wall_clock_deadline),
    (stall_timeout.__name__, stall_deadline),
    (slow_pool_starved.__name__, slow_pool_deadline),
)


def next_deadline(r: LiveRequest, p: RuleSettings, starvation_wait_s: float | None) -> float:
    """The earliest time a time rule (not decided yet) or the starvation alert can fire for ``r`` as it
    is now; infinity when none can until its state changes."""
    if r.finished or "abort" in r.decided:
        return math.inf
    out = math.inf
    for name, deadline in _DEADLINES:
        if name not in r.decided:
            d = deadline(r, p)
            if d is not None and d < out:
                out = d
    if starvation_wait_s is not None and r.waiting_since is not None and not r.starvation_alerted:
        out = min(out, r.waiting_since + starvation_wait_s)
    return out


def evaluate(
    r: LiveRequest, p: RuleSettings, now: float, rules: tuple[Rule, ...] = ALL_RULES
) -> list[Verdict]:
    """The new verdicts for ``r``; ``record`` them into ``r.decided`` once acted on.

    A rule or an action already decided is not decided again; after an abort nothing else is."""
    if r.finished or "abort" in r.decided:
        return []
    out: list[Verdict] = []
    for rule in rules:
        if rule.__name__ in r.decided:
            continue
        v = rule(r, p, now)
        if v is None or v.action in r.decided or any(o.action == v.action for o in out):
            continue
        out.append(v)
        if v.action == "abort":
            return [v]  # the request is being cut: other actions are moot
    return out


def record(r: LiveRequest, v: Verdict, now: float) -> None:
    """Mark ``v`` as decided for ``r`` (its rule and its action)."""
    r.decided.add(v.rule)
    r.decided.add(v.action)
    if v.action == "slow_pool":
        r.slow_pool_ts = now
