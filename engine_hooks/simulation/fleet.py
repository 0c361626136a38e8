"""The fleet: engines and a gateway on one virtual clock, paced to the wall clock.

Its engines and its gateway see it through the small protocols they declare (``engine.EngineHost``,
``gateway.GatewayHost``) and do not import it."""

from __future__ import annotations

import heapq
import math
import random
import time
from typing import TYPE_CHECKING, Any, TypedDict

from engine_hooks.events import Command
from engine_hooks.simulation.engine import SimEngine
from engine_hooks.simulation.gateway import SimGateway
from engine_hooks.simulation.scenario import BLOCK_TOKENS, Scenario, SimRequest

if TYPE_CHECKING:
    from engine_hooks.exporter import Exporter


class ExporterTotals(TypedDict):
    """The fleet's exporters' counters, summed over its sources."""

    sent: int
    retried: int
    spooled: int
    replayed: int
    dropped: dict[str, int]  # by reason


class FleetSummary(TypedDict):
    """What the fleet emitted and its exporters delivered (:meth:`Fleet.summary`)."""

    requests: int  # requests that arrived
    finished: dict[str, int]  # requests that finished, by reason
    emitted: dict[str, int]  # events emitted, by source id
    last_seq: dict[str, int | None]  # the last seq given, by source id (None before the first)
    exporter: ExporterTotals


class Fleet:
    """Drives arrivals and engine steps in virtual time, paced to the wall clock."""

    def __init__(
        self,
        *,
        engines: int,
        rps: float,
        scenario: Scenario,
        seed: int,
        make_exporter: Any,
        source_prefix: str = "sim",
    ):
        self.rps = rps
        self.sc = scenario
        self.seed = seed
        self.source_prefix = source_prefix  # also in request ids: runs with distinct prefixes never mix
        self.rng = random.Random(seed)
        self.requests: dict[str, SimRequest] = {}
        self.start_wall = time.time()
        self.exporters: dict[str, Exporter] = {}
        self.engines: list[SimEngine] = []
        for i in range(engines):
            sid = f"{source_prefix}-engine-{i}"

            def on_command(command: Command, _sid: str = sid) -> None:
                self.by_id[_sid].commands.put(command)

            exporter = make_exporter(sid, "engine", on_command)
            self.exporters[sid] = exporter
            engine = SimEngine(sid, scenario, exporter, seed * 1000 + i + 1, self)
            self.engines.append(engine)
        self.by_id = {e.id: e for e in self.engines}
        gid = f"{source_prefix}-gateway-0"
        self.exporters[gid] = make_exporter(gid, "gateway", None)
        self.gateway = SimGateway(
            gid, self.exporters[gid], self, max_in_flight=int(engines * scenario.max_num_seqs * 1.5)
        )
        self._heap: list[tuple[float, int, str, int]] = []
        self._tie = 0
        self.request_count = 0
        self.finished: dict[str, int] = {}

    def ts(self, t: float) -> float:
        return self.start_wall + t

    def _push(self, t: float, what: str, idx: int = 0) -> None:
        self._tie += 1
        heapq.heappush(self._heap, (t, self._tie, what, idx))

    def _new_request(self, t: float) -> SimRequest:
        sc, rng = self.sc, self.rng
        self.request_count += 1
        u = rng.random()
        if u < sc.very_long_prompt_p:
            prompt = sc.very_long_prompt_tokens
        elif u < sc.very_long_prompt_p + sc.long_prompt_p:
            prompt = rng.randint(4000, 12000)
        else:
            prompt = max(8, int(rng.lognormvariate(math.log(sc.prompt_median), sc.prompt_sigma)))
        runaway = rng.random() < sc.runaway_p
        output = max(1, int(rng.lognormvariate(math.log(sc.output_median), sc.output_sigma)))
        max_tokens: int | None = sc.max_tokens
        if runaway:
            max_tokens, output = None, sc.runaway_cap
        else:
            output = min(output, sc.max_tokens)
        cached = (rng.randint(1, max(1, prompt // 2)) // BLOCK_TOKENS) * BLOCK_TOKENS
        cached = cached if rng.random() < sc.prefix_hit_p else 0
        disconnect = rng.randint(1, output) if rng.random() < sc.disconnect_p else None
        req = SimRequest(
            id=f"{self.source_prefix}-{self.seed}-req-{self.request_count:07d}",
            prompt_tokens=prompt,
            max_tokens=max_tokens,
            target_output=output,
            cached_tokens=min(cached, prompt - 1),
            runaway=runaway,
            disconnect_at=disconnect,
            arrived_t=t,
        )
        self.requests[req.id] = req
        return req

    def route(self, req: SimRequest, t: float) -> None:
        engine = min(self.engines, key=lambda e: (e.load, e.id))
        engine.add(req, t)
        if not engine.busy:
            engine.busy = True
            self._push(t, "step", self.engines.index(engine))

    def on_first_token(self, req: SimRequest, t: float) -> None:
        self.gateway.first_token(req, t)

    def on_disconnect(self, req: SimRequest, t: float) -> None:
        pass  # the gateway reports it in done(); the engine aborts the request

    def on_finished(self, req: SimRequest, t: float, reason: str) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self.gateway.done(req, t, reason)
        del self.requests[req.id]

    def run(self, duration_s: float, pace: bool = True) -> float:
        """Simulate ``duration_s`` of virtual time; returns how far behind the wall clock it ended."""
        self.start_wall = time.time()
        self._push(self.rng.expovariate(self.rps), "arrival")
        lag = 0.0
        while self._heap:
            t, _, what, idx = heapq.heappop(self._heap)
            if t > duration_s:
                break
            if pace:
                ahead = self.start_wall + t - time.time()
                if ahead > 0.002:
                    time.sleep(ahead)
                lag = max(0.0, -ahead)
            if what == "arrival":
                entry_s = self.sc.gateway_entry_s * (0.5 + self.rng.random())
                self.gateway.arrive(self._new_request(t - entry_s), t, entry_s)
                self._push(t + self.rng.expovariate(self.rps), "arrival")
            else:
                engine = self.engines[idx]
                if engine.load == 0:
                    engine.busy = False
                    continue
                self._push(t + engine.step(t), "step", idx)
        return lag

    def summary(self) -> FleetSummary:
        emitted = {e.id: e.emitted for e in self.engines}
        emitted[self.gateway.id] = self.gateway.emitted
        stats = {sid: ex.stats() for sid, ex in self.exporters.items()}
        dropped: dict[str, int] = {}
        for s in stats.values():
            for reason, n in s.dropped.items():
                dropped[reason] = dropped.get(reason, 0) + n
        return {
            "requests": self.request_count,
            "finished": dict(sorted(self.finished.items())),
            "emitted": emitted,
            "last_seq": {sid: s.last_seq for sid, s in stats.items()},
            "exporter": {
                "sent": sum(s.sent for s in stats.values()),
                "retried": sum(s.retried for s in stats.values()),
                "spooled": sum(s.spooled for s in stats.values()),
                "replayed": sum(s.replayed for s in stats.values()),
                "dropped": dropped,
            },
        }
