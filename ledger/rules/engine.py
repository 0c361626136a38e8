"""The live rule engine: per-request state fed by accepted events, rules evaluated on events and on a ticker.

The runaway service calls ``observe`` with each batch's new events as soon as the batch is decoded
(events at or below the source's mark are skipped, or observed after the commit when the store took
them as new), so the state sees every event once. Counter rules (token cap, loop, preemption and
forced-wait limits) run at the end of each observed batch for the requests it touched, after all of
that batch's events, so a request that finished in the same batch is never cut; for the same reason a
request's output token ids are fed to its loop detector once per batch, all of them in order. Time rules
(wall-clock and stall timeouts, slow-pool starvation) and the starvation alert run on ``tick``.

Clocks: time rules run on the ledger's clock only. Each event counts as happening when its batch was
received (``recv_ts``), never at its source's ``ts``: an event is always received after it happened, so
every age is measured short by the delivery delay (a flush interval; the outage, for events replayed
from a spool) and a time rule fires late by that, never early, whatever a source's clock says. (An
earlier design mapped ``ts`` onto the ledger's clock with a per-source offset, the smallest
``receive - ts`` seen: one event stamped an hour ahead made every request of that source look an hour
old, and the wall-clock rule aborted normal requests.)

Memory is bounded: a request leaves the live set when it finishes (engine ``finished``, or the gateway
is done and no engine has it), when it has had no event for ``idle_evict_s``, or, least recently touched
first, when more than ``max_live`` requests are live. A loop detector keeps at most
``max(min_span_tokens, min_repeats * max_period + confirm_tokens) + 1`` tokens
(see ``ledger.rules.loop``); a paraphrase detector (off by default) one entry per distinct phrase of
the output (see ``ledger.rules.paraphrase``).
"""

from __future__ import annotations

import heapq
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engine_hooks import events as ev
from ledger.columnar import Columns
from ledger.rules import rules as R
from ledger.rules import step_tokens
from ledger.rules.loop import exact_detector, extend_many, near_detector
from ledger.rules.paraphrase import paraphrase_detector
from ledger.rules.policy import Policy, RuleSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decision:
    request_id: str
    rule: str
    action: str
    detail: str
    model: str | None
    engine_source_id: str | None  # where the engine runs it (abort / slow pool there)
    gateway_source_id: str | None  # the gateway streaming it, when one is (it cuts the stream)
    decided_ts: float  # ledger clock


class Hooks(Protocol):
    """What the engine reports; the runaway service implements it (store, deliver, alert, count)."""

    def decided(self, decisions: list[Decision]) -> None: ...
    def confirmed(self, source_id: str, command_id: str, ts: float) -> None: ...
    def request_done(self, request_id: str, source_id: str, kind: str) -> None: ...
    def gateway_joined(self, request_id: str, source_id: str) -> None: ...
    def dropped(self, source: ev.Source, count: int, reason: str, ts: float) -> None: ...
    def starving(self, r: R.LiveRequest, waited_s: float, now: float) -> None: ...


_TICK_SLICE = 2000  # requests the ticker looks at under one hold of the lock


class RuleEngine:
    def __init__(
        self,
        policy: Callable[[], Policy],
        hooks: Hooks,
        *,
        max_live: int = 200_000,
        idle_evict_s: float = 4 * 3600.0,
        clock: Callable[[], float] = time.time,
        mono: Callable[[], float] = time.monotonic,
    ) -> None:
        self._policy = policy
        self._hooks = hooks
        self.max_live = max_live
        self.idle_evict_s = idle_evict_s
        self._clock = clock
        self._mono = mono
        self._lock = threading.RLock()
        self.live: OrderedDict[str, R.LiveRequest] = OrderedDict()  # least recently touched first
        self._done: OrderedDict[str, None] = OrderedDict()  # recently finished ids (late events ignored)
        self._rules_cache: tuple[Policy | None, dict[str | None, RuleSettings]] = (None, {})
        self._stalled: dict[str, tuple[str, int]] = {}  # source -> (model, KV-stalled in its last step)
        self._ticked_policy: Policy | None = None  # the policy of the last tick's deadlines
        self._deadlines: list[tuple[float, str]] = []  # heap of (LiveRequest.scheduled, request id)
        self._changed: dict[str, R.LiveRequest] = {}  # touched since the last tick

    # -- policy ------------------------------------------------------------------------------------
    def rules_for(self, model: str | None) -> RuleSettings:
        policy = self._policy()
        cached_for, cache = self._rules_cache
        if cached_for is not policy:
            cache = {}
            self._rules_cache = (policy, cache)
        s = cache.get(model)
        if s is None:
            s = cache[model] = policy.rules_for(model)
        return s

    # -- events ------------------------------------------------------------------------------------
    def observe(
        self,
        source: ev.Source,
        events: Sequence[Any],
        recv_ts: float | None = None,
        columns: Columns | None = None,
    ) -> list[Decision]:
        """Fold newly accepted events of one batch into the live state; decide counter rules.
        ``columns``: the columnar message ``events`` are the whole of, whose steps' tokens are grouped
        from its columns."""
        if not events:
            return []
        now = self._clock() if recv_ts is None else recv_ts
        with self._lock:
            touched: dict[str, R.LiveRequest] = {}
            signals: list[tuple[Any, ...]] = []
            # Output token ids per request, fed to its loop detector once per batch (the counter rules
            # run at the end of the batch anyway).
            token_ids: dict[R.LiveRequest, list[int]] = {}
            mono = self._mono()
            tokens_cls, step_cls = ev.Tokens, ev.Step
            stepped: list[ev.Step] = []  # steps carrying output tokens, taken per request at the end
            for e in events:
                if type(e) is not tokens_cls:
                    if type(e) is step_cls and e.token_counts:
                        stepped.append(e)
                    self._apply(source, e, now, touched, signals, mono)
                    continue
                # ``tokens``, the bulk of any stream, here rather than in ``_apply``.
                r = self._touch(e.request_id, source, touched, mono)
                if r is None:
                    continue
                if e.total > r.output_tokens:
                    r.output_tokens = e.total
                r.last_progress_ts = now
                r.running, r.waiting_since = True, None
                ids = e.token_ids
                if ids:
                    pending = token_ids.get(r)
                    if pending is None:
                        token_ids[r] = list(ids)
                    else:
                        pending += ids
            if stepped:
                groups = (
                    step_tokens.group(stepped)
                    if columns is None
                    else step_tokens.group_columns(columns.steps, columns.ids)
                )
                self._step_tokens(source, groups, now, touched, token_ids, mono)
            self._detect(token_ids, touched)
            decisions = self._decide(touched.values(), R.EVENT_RULES, now)
            self._bound()
        # Reported outside the lock, in event order, decisions last (a confirmation in this batch is
        # for an older command).
        hooks = self._hooks
        for sig in signals:
            if sig[0] == "confirmed":
                hooks.confirmed(*sig[1:])
            elif sig[0] == "done":
                hooks.request_done(*sig[1:])
            elif sig[0] == "gateway":
                hooks.gateway_joined(*sig[1:])
            else:
                hooks.dropped(*sig[1:])
        if decisions:
            hooks.decided(decisions)
        return decisions

    def _step_tokens(
        self,
        source: ev.Source,
        groups: list[step_tokens.Group],
        now: float,
        touched: dict[str, R.LiveRequest],
        token_ids: dict[R.LiveRequest, list[int]],
        mono: float,
    ) -> None:
        """The output tokens the batch's steps carried (``groups``), once per request (after the batch's
        other events: a request that finished in the batch is not made live again): what its
        ``tokens`` events would have done. Such a request is checked by the counter rules only when its
        total is above the token cap (or, see ``_detect``, its loop detector fired): nothing else a
        token changes can make them decide, and a busy engine's steps touch every running request."""
        touch = self._touch
        cap = self.rules_for(source.model).max_output_tokens if source.model else None
        quiet: dict[str, R.LiveRequest] = {}  # touched, but nothing for the counter rules to check
        for rid, total, ids in groups:
            r = touch(rid, source, quiet, mono)
            if r is None:
                continue
            if total > r.output_tokens:
                r.output_tokens = total
            if cap is None or total > cap or r.model != source.model:
                touched[rid] = r
            r.last_progress_ts = now
            r.running, r.waiting_since = True, None
            if ids:
                pending = token_ids.get(r)
                if pending is None:
                    token_ids[r] = ids
                else:
                    pending += ids

    def _touch(
        self, rid: str, source: ev.Source, touched: dict[str, R.LiveRequest], mono: float
    ) -> R.LiveRequest | None:
        """The live request ``rid`` (made on its first event), marked as touched by ``source``; None
        when it has finished already (a late event), or when another source of ``source``'s kind
        serves it (its first engine and its first gateway do: ``ledger.store.request_owners``, whose
        409 refuses the same events at the store)."""
        r = self.live.get(rid)
        engine = source.kind == "engine"
        if r is None:
            if rid in self._done:
                return None
            r = self.live[rid] = R.LiveRequest(request_id=rid)
        else:
            if _served_by_another(r, source):
                return None
            self.live.move_to_end(rid)
        r.touched_mono = mono
        self._changed[rid] = r  # its deadlines may move: the ticker looks at it again
        touched[rid] = r
        if engine:
            r.engine_source_id = source.id
            if source.model:
                r.model = source.model
        else:
            r.gateway_source_id = source.id
        return r

    def _detect(self, token_ids: dict[R.LiveRequest, list[int]], touched: dict[str, R.LiveRequest]) -> None:
        """Feed each request's new output token ids to its loop detectors and its paraphrase detector
        (made on its first ids, those of the rules its model has on), all in one call (``extend_many``:
        compiled, the detectors' state read once per batch); a request whose detector fired is checked
        by the counter rules."""
        detectors: list[Any] = []
        owners: list[R.LiveRequest] = []
        counts: list[int] = []
        flat: list[int] = []
        for r, ids in token_ids.items():
            if r.detector is None and r.near_detector is None and r.paraphrase_detector is None:
                self._make_detectors(r)
            n = len(ids)
            for d in (r.detector, r.near_detector, r.paraphrase_detector):
                if d is not None and d.hit is None:
                    detectors.append(d)
                    owners.append(r)
                    counts.append(n)
                    flat += ids
        if detectors:
            for k in extend_many(detectors, counts, flat):
                touched[owners[k].request_id] = owners[k]

    def _make_detectors(self, r: R.LiveRequest) -> None:
        """The detectors of the loop rules the request's model has on."""
        rules = self.rules_for(r.model)
        if rules.loop.enabled:
            r.detector = exact_detector(rules.loop)
        if rules.near_loop.enabled:
            r.near_detector = near_detector(rules.near_loop)
        if rules.paraphrase_loop.enabled:
            r.paraphrase_detector = paraphrase_detector(rules.paraphrase_loop)

    def _apply(
        self,
        source: ev.Source,
        e: Any,
        t: float,
        touched: dict[str, R.LiveRequest],
        signals: list[tuple[Any, ...]],
        mono: float,
    ) -> None:
        """Every event kind but ``tokens`` (handled in ``observe``)."""
        kind = e.__struct_config__.tag
        if kind == "step":
            self._step(source, e, t, touched)
            return
        if kind == "dropped":
            signals.append(("dropped", source, e.count, e.reason, t))
            return
        if kind == "cutoff_applied":
            signals.append(("confirmed", source.id, e.command_id, t))
            return
        rid = e.request_id
        if kind in ("finished", "completed", "client_disconnected", "stream_cut"):
            r = self.live.get(rid)
            if r is not None and _served_by_another(r, source):
                return
            if kind == "stream_cut" and e.command_id:
                signals.append(("confirmed", source.id, e.command_id, t))
            signals.append(("done", rid, source.id, kind))
            if r is None:
                return
            if kind == "finished" or r.engine_source_id is None:
                self._finish(rid, r)
            else:
                r.gateway_streaming = False
            return
        r = self._touch(rid, source, touched, mono)
        if r is None:
            return
        if kind == "chunk":
            r.last_progress_ts = t
            r.running, r.waiting_since = True, None
        elif kind == "queued":
            r.admitted_ts = t if r.admitted_ts is None else min(r.admitted_ts, t)
            if not r.running:
                r.waiting_since = t
        elif kind == "preempted":
            r.preemptions += 1
            r.running, r.waiting_since = False, t
        elif kind == "resumed":
            r.running, r.waiting_since = True, None
            r.last_progress_ts = t
        elif kind == "arrived":
            joined = e.stream and not r.gateway_streaming
            r.gateway_streaming = bool(e.stream)
            if joined and r.decided:  # decided before the gateway's events came: it is a target too
                signals.append(("gateway", rid, source.id))
        elif kind == "admitted":
            r.admitted_ts = t if r.admitted_ts is None else min(r.admitted_ts, t)

    def _step(self, source: ev.Source, e: ev.Step, t: float, touched: dict[str, R.LiveRequest]) -> None:
        live = self.live
        ours = (source.id, None)  # requests another engine serves are not this step's
        if not e.token_counts:  # with them, each runner got a token (``_step_tokens``) or a chunk
            for rid in e.request_ids:
                r = live.get(rid)
                if r is not None and r.engine_source_id in ours:
                    r.last_progress_ts = t
        stalled = 0
        for rid in e.stalled_request_ids:
            r = live.get(rid)
            if r is not None and r.engine_source_id in ours:
                r.forced_waits += 1
                stalled += 1
                touched[rid] = r  # the forced-wait limit is checked with the batch's counter rules
        self._stalled[source.id] = (source.model or "", stalled)

    def _finish(self, rid: str, r: R.LiveRequest) -> None:
        r.finished = True
        self.live.pop(rid, None)
        self._done[rid] = None
        while len(self._done) > 2 * self.max_live:
            self._done.popitem(last=False)

    def _decide(self, reqs: Any, rules: tuple[R.Rule, ...], now: float) -> list[Decision]:
        out = []
        for r in reqs:
            if r.finished:
                continue
            for v in R.evaluate(r, self.rules_for(r.model), now, rules):
                R.record(r, v, now)
                out.append(
                    Decision(
                        request_id=r.request_id,
                        rule=v.rule,
                        action=v.action,
                        detail=v.detail,
                        model=r.model,
                        engine_source_id=r.engine_source_id,
                        gateway_source_id=r.gateway_source_id if r.gateway_streaming else None,
                        decided_ts=now,
                    )
                )
        return out

    def _bound(self) -> None:
        while len(self.live) > self.max_live:
            rid, _r = self.live.popitem(last=False)
            log.warning("live rule state full (%d requests): dropping the oldest, %s", self.max_live, rid)

    # -- time --------------------------------------------------------------------------------------
    def tick(self, now: float | None = None) -> list[Decision]:
        """Time rules, the starvation alert and idle eviction.

        Only the live requests whose earliest deadline (``rules.next_deadline``) has passed, from a heap,
        and the ones an event changed since the last tick are evaluated. A pass over every live request
        held the interpreter for 90 ms per 100,000 requests every tick (most of them waiting,
        untouched), and the ingest writer waited for it."""
        now = self._clock() if now is None else now
        mono = self._mono()
        policy = self._policy()
        starve = policy.alerts.starvation_wait_s
        with self._lock:
            if policy is not self._ticked_policy:  # other limits: every deadline moves
                self._ticked_policy = policy
                self._changed.update(self.live)
            due, self._changed = self._changed, {}
            heap, live = self._deadlines, self.live
            while heap and heap[0][0] <= now:
                at, rid = heapq.heappop(heap)
                r = live.get(rid)
                if r is not None and r.scheduled == at:  # else finished, evicted, or rescheduled
                    r.scheduled = math.inf
                    due[rid] = r
        decisions: list[Decision] = []
        starving = []
        looked = list(due.items())
        # In slices, each under the lock: the batches that arrive meanwhile are observed in between (100,000
        # new requests take 0.3 s to look at, and every ingest answer waits for its batch's observation).
        for i in range(0, len(looked), _TICK_SLICE):
            with self._lock:
                part = looked[i : i + _TICK_SLICE]
                decisions += self._decide([r for _, r in part], R.TIME_RULES, now)
                for rid, r in part:
                    if (
                        starve is not None
                        and r.waiting_since is not None
                        and not r.starvation_alerted
                        and now - r.waiting_since > starve
                    ):
                        r.starvation_alerted = True
                        starving.append((r, now - r.waiting_since))
                    at = R.next_deadline(r, self.rules_for(r.model), starve)
                    if at < r.scheduled and live.get(rid) is r:  # later: its entry pops first, then this
                        r.scheduled = at
                        heapq.heappush(heap, (at, rid))
        with self._lock:
            if len(heap) > 2 * len(live) + 10_000:  # entries of requests gone or rescheduled
                self._deadlines = [(r.scheduled, rid) for rid, r in live.items() if r.scheduled < math.inf]
                heapq.heapify(self._deadlines)
            while self.live:
                _rid, r = next(iter(self.live.items()))
                if mono - r.touched_mono <= self.idle_evict_s:
                    break
                self.live.popitem(last=False)
        if decisions:
            self._hooks.decided(decisions)
        for r, waited in starving:
            self._hooks.starving(r, waited, now)
        return decisions

    # -- views -------------------------------------------------------------------------------------
    def live_counts(self) -> dict[str, int]:
        with self._lock:
            out: dict[str, int] = {}
            for r in self.live.values():
                m = r.model or ""
                out[m] = out.get(m, 0) + 1
            return out

    def kv_stalled_counts(self) -> dict[str, int]:
        """Per model: requests holding KV that got no token in their engine's latest step."""
        with self._lock:
            out: dict[str, int] = {}
            for model, n in self._stalled.values():
                out[model] = out.get(model, 0) + n
            return out

    def kv_stall_max_s(self, now: float | None = None) -> dict[str, float]:
        """Per model: the longest time a live request has held its place without a new token."""
        now = self._clock() if now is None else now
        with self._lock:
            out: dict[str, float] = {}
            for r in self.live.values():
                if r.last_progress_ts is None:
                    continue
                m = r.model or ""
                out[m] = max(out.get(m, 0.0), now - r.last_progress_ts)
            return out

    def get(self, request_id: str) -> R.LiveRequest | None:
        with self._lock:
            return self.live.get(request_id)


def _served_by_another(r: R.LiveRequest, source: ev.Source) -> bool:
    """Whether another source of ``source``'s kind serves the live request ``r``."""
    owner = r.engine_source_id if source.kind == "engine" else r.gateway_source_id
    return owner is not None and owner != source.id
