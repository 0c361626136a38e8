"""Fleet simulator: realistic event streams from N engines and a gateway, through the real exporter.

A load and scale tool, not an engine. Time is virtual and paced to the wall clock: each engine step
and each arrival happens at ``start + virtual time``; when the machine cannot keep up, the run falls
behind (reported as ``lag_s``) instead of changing what is emitted. Everything that is emitted is
decided by random generators seeded from ``--seed``, so two runs with the same arguments emit the same
events (the timestamps aside), unless the ledger sends commands (a cutoff changes what follows).

Model, per engine (vLLM v1 style):

* arrivals: Poisson at ``rps`` for the fleet; the gateway admits up to ``engines * max_num_seqs * 1.5``
  requests in flight and routes each to the engine with the fewest requests;
* prompt lengths: log-normal around ``prompt_median`` tokens, with rare long prompts (4k-12k) and
  rarer very long ones (the 20k-token prefill); outputs log-normal around ``output_median``;
* scheduling under a token budget (``max_num_batched_tokens``): running requests first (a partial
  prefill continues, each decode takes one token), then waiting ones; long prefills are chunked, and
  optionally capped per step (``long_prefill_token_threshold``);
* step time = a + b * prefill tokens + c * prefill tokens * depth + d * decode requests;
* KV cache in 16-token blocks; when a decode cannot get a block, the most recently arrived running
  request is preempted (its blocks freed; it recomputes when resumed);
* runaways: a few requests have no token cap and no stop, and repeat a short token loop until the
  simulator's hard cap (or until the ledger cuts them off with an ``abort`` command);
* tokens are coalesced per request and sent every ``tokens_flush`` tokens and at the end.
"""

from __future__ import annotations

import heapq
import json
import logging
import math
import os
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

import typer

from engine_hooks.config import ConfigError, ExporterConfig
from engine_hooks.events import (
    AdmissionEnqueued,
    Admitted,
    Arrived,
    Chunk,
    ClientDisconnected,
    Command,
    Completed,
    CutoffApplied,
    Finished,
    FirstByte,
    FirstTokenOut,
    Preempted,
    Queued,
    Resumed,
    Step,
    StreamCut,
    Tokens,
)
from engine_hooks.fields import (
    CHUNK_FIELDS,
    CUTOFF_APPLIED_FIELDS,
    FINISHED_FIELDS,
    PREEMPTED_FIELDS,
    QUEUED_FIELDS,
    RESUMED_FIELDS,
    STEP_FIELDS,
    TOKENS_FIELDS,
)

if TYPE_CHECKING:  # the exporter (httpx) loads when a simulation starts, not with the command line
    from engine_hooks.exporter import Exporter

log = logging.getLogger(__name__)

BLOCK_TOKENS = 16


@dataclass(frozen=True)
class Scenario:
    """Knobs of one simulated fleet; ``SCENARIOS`` holds the named presets."""

    prompt_median: int = 600
    prompt_sigma: float = 0.9
    long_prompt_p: float = 0.01  # share of prompts of 4k-12k tokens
    very_long_prompt_p: float = 0.002  # share of 20k-token prompts
    very_long_prompt_tokens: int = 20_000
    output_median: int = 180
    output_sigma: float = 0.8
    max_tokens: int = 2048  # client cap on ordinary requests
    runaway_p: float = 0.003  # share of requests with no cap and no stop that loop
    runaway_cap: int = 6000  # the simulator's own hard stop for runaways
    prefix_hit_p: float = 0.3  # share of requests with a prefix-cache hit
    disconnect_p: float = 0.005  # share of clients that go away mid-stream
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0  # 0: no per-request cap per step
    kv_blocks: int = 16_384  # KV cache size per engine, in 16-token blocks
    step_a_s: float = 0.004  # fixed cost of a step
    step_b_s: float = 12e-6  # per prefill token
    step_c_s: float = 8e-10  # per prefill token per token of depth (attention over the prefix)
    step_d_s: float = 40e-6  # per decode request
    tokens_flush: int = 16  # output tokens coalesced per tokens event
    gateway_entry_s: float = 0.002  # parsing, auth, tokenising at the gateway


SCENARIOS: dict[str, Scenario] = {
    "steady": Scenario(),
    "long-prompts": Scenario(long_prompt_p=0.05, very_long_prompt_p=0.02),
    "kv-pressure": Scenario(kv_blocks=2048, output_median=400),
    "runaway": Scenario(runaway_p=0.05),
    "chunk-threshold": Scenario(very_long_prompt_p=0.02, long_prefill_token_threshold=256),
}


@dataclass(eq=False)
class SimRequest:
    id: str
    prompt_tokens: int
    max_tokens: int | None
    target_output: int
    cached_tokens: int
    runaway: bool
    disconnect_at: int | None  # output token count at which the client goes away
    arrived_t: float
    queued_t: float = 0.0
    computed: int = 0  # tokens whose KV is computed (prefill progress, then prompt + output)
    output: int = 0
    blocks: int = 0
    preemptions: int = 0
    chunks: int = 0
    waiting_since: float = 0.0
    lost_tokens: int = 0  # computed tokens thrown away by preemptions (recomputed on resume)
    first_token_t: float | None = None
    pending_ids: list[int] = field(default_factory=list)
    pending_first_t: float | None = None
    finished: bool = False
    state: str = "waiting"  # waiting | running | done
    cutoff: Command | None = None

    @property
    def prefilling(self) -> bool:
        """Whether the next pass is a prefill (first pass, or recompute after a preemption).

        In decode, every token but the last sampled one is computed (vLLM's num_computed_tokens is
        num_tokens - 1), so a prefill is any pass that starts further behind than that."""
        return self.computed < self.prompt_tokens + max(self.output - 1, 0)

    def next_token(self, rng: random.Random) -> int:
        if self.runaway:
            return (101, 2023, 318)[self.output % 3]
        return rng.randrange(100, 50_000)


def _new_prompt_tokens(req: SimRequest, n: int) -> int:
    """Of a chunk of ``n`` tokens at ``req.computed``, the prompt positions never computed before.

    Everything else in the chunk is recomputation: positions a preemption threw away, and output
    positions (past the prompt) that decode had already computed.
    """
    high = max(min(req.lost_tokens, req.prompt_tokens), req.computed)
    return max(0, min(req.computed + n, req.prompt_tokens) - high)


class SimEngine:
    """One engine: waiting and running queues, a KV block pool, a step clock; emits engine events."""

    def __init__(self, source_id: str, scenario: Scenario, exporter: Exporter, seed: int, fleet: Fleet):
        self.id = source_id
        self.sc = scenario
        self.exporter = exporter
        self.rng = random.Random(seed)
        self.fleet = fleet
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.free_blocks = scenario.kv_blocks
        self.step_no = 0
        self.busy = False
        self.emitted = 0
        self.commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.e_queued = exporter.emitter(Queued, *QUEUED_FIELDS)
        self.e_chunk = exporter.emitter(Chunk, *CHUNK_FIELDS)
        self.e_tokens = exporter.emitter(Tokens, *TOKENS_FIELDS)
        self.e_preempted = exporter.emitter(Preempted, *PREEMPTED_FIELDS)
        self.e_resumed = exporter.emitter(Resumed, *RESUMED_FIELDS)
        self.e_finished = exporter.emitter(Finished, *FINISHED_FIELDS)
        self.e_cutoff = exporter.emitter(CutoffApplied, *CUTOFF_APPLIED_FIELDS)
        self.e_step = exporter.emitter(Step, *STEP_FIELDS)

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, req: SimRequest, t: float) -> None:
        req.queued_t = req.waiting_since = t
        self.waiting.append(req)
        # no front-end arrival time, default priority (the fields the plugin also sends)
        self.e_queued(self.fleet.ts(t), req.id, req.prompt_tokens, req.max_tokens, None, 0)
        self.emitted += 1

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // BLOCK_TOKENS)

    def _preempt(self, victim: SimRequest, t: float) -> None:
        self.running.remove(victim)
        self.free_blocks += victim.blocks
        self.e_preempted(self.fleet.ts(t), victim.id, victim.blocks, victim.computed)
        self.emitted += 1
        victim.blocks = 0
        victim.lost_tokens = max(victim.lost_tokens, victim.computed)
        victim.computed = 0  # recomputed on resume (no prefix cache for its own output here)
        victim.preemptions += 1
        victim.waiting_since = t
        victim.state = "waiting"
        self.waiting.appendleft(victim)

    def _allocate(self, req: SimRequest, new_tokens: int, t: float, planned: set[str]) -> bool:
        """Blocks for ``new_tokens`` more tokens, preempting the newest running request not yet
        scheduled this step when the pool is short; False when there is none left to preempt."""
        need = self._blocks_for(req.computed + new_tokens) - req.blocks
        while need > self.free_blocks:
            victims = [r for r in self.running if r is not req and r.id not in planned]
            if not victims:
                return False
            self._preempt(max(victims, key=lambda r: r.arrived_t), t)
        self.free_blocks -= max(need, 0)
        req.blocks += max(need, 0)
        return True

    def apply_commands(self, t: float) -> None:
        while True:
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return
            req = self.fleet.requests.get(command.request_id)
            if req is None or req.finished or command.action != "abort":
                continue
            req.cutoff = command
            self.e_cutoff(self.fleet.ts(t), req.id, command.id, command.action, command.rule)
            self.emitted += 1
            self._finish(req, t, "cutoff", f"chunkledger:{command.rule}")

    def _finish(self, req: SimRequest, t: float, reason: str, stop_reason: str | None) -> None:
        self._flush_tokens(req, t)
        was_waiting = req.state == "waiting"
        if was_waiting:
            self.waiting.remove(req)
        elif req.state == "running":
            self.running.remove(req)
        req.state = "done"
        self.free_blocks += req.blocks
        req.blocks = 0
        req.finished = True
        wait_s = t - req.waiting_since if was_waiting else None
        self.e_finished(self.fleet.ts(t), req.id, reason, req.output, stop_reason, wait_s)
        self.emitted += 1
        self.fleet.on_finished(req, t, reason)

    def _flush_tokens(self, req: SimRequest, t: float) -> None:
        if not req.pending_ids:
            return
        first = req.pending_first_t if req.pending_first_t is not None else t
        self.e_tokens(
            self.fleet.ts(t),
            req.id,
            len(req.pending_ids),
            req.output,
            self.fleet.ts(first),
            req.blocks,
            req.pending_ids,
        )
        self.emitted += 1
        req.pending_ids = []
        req.pending_first_t = None

    def step(self, t: float) -> float:
        """Schedule and 'run' one step starting at virtual time ``t``; returns its duration."""
        sc = self.sc
        self.apply_commands(t)
        budget = sc.max_num_batched_tokens
        cap = sc.long_prefill_token_threshold or budget
        plan: list[tuple[SimRequest, int]] = []
        chunk_rows = []
        ts = self.fleet.ts(t)
        planned: set[str] = set()
        for req in list(self.running):
            if req.state != "running" or budget <= 0:
                continue
            n = min(req.prompt_tokens + req.output - req.computed, budget, cap) if req.prefilling else 1
            if not self._allocate(req, n, t, planned):
                self._preempt(req, t)
                continue
            budget -= n
            plan.append((req, n))
            planned.add(req.id)
        while self.waiting and budget > 0 and len(self.running) < sc.max_num_seqs:
            req = self.waiting[0]
            if req.preemptions == 0 and req.chunks == 0 and req.computed == 0:
                req.computed = req.cached_tokens
            n = min(req.prompt_tokens + req.output - req.computed, budget, cap)
            if not self._allocate(req, n, t, planned):
                break
            self.waiting.popleft()
            self.running.append(req)
            req.state = "running"
            planned.add(req.id)
            if req.preemptions:
                self.e_resumed(ts, req.id, t - req.waiting_since, 0, req.output)
                self.emitted += 1
            budget -= n
            plan.append((req, n))
        prefill_tokens = decode_reqs = prefill_reqs = 0
        depth_work = max_depth = 0
        for req, n in plan:
            if req.prefilling:
                prefill_reqs += 1
                prefill_tokens += n
                depth_work += n * req.computed
                max_depth = max(max_depth, req.computed)
                wait_s = t - req.queued_t if req.chunks == 0 else None
                chunk_rows.append(
                    (
                        ts,
                        req.id,
                        self.step_no,
                        n,
                        req.computed,
                        n - _new_prompt_tokens(req, n),
                        req.cached_tokens if req.chunks == 0 else 0,  # prefix hits: first chunk only
                        req.blocks,
                        req.preemptions,
                        wait_s,
                    )
                )
                req.chunks += 1
            else:
                decode_reqs += 1
        duration = (
            sc.step_a_s + sc.step_b_s * prefill_tokens + sc.step_c_s * depth_work + sc.step_d_s * decode_reqs
        )
        if chunk_rows:
            self.e_chunk.many(chunk_rows)
            self.emitted += len(chunk_rows)
        end = t + duration
        for req, n in plan:
            if req.finished:
                continue
            req.computed += n
            if req.prefilling:
                continue  # a partial prefill produces no token
            req.pending_ids.append(req.next_token(self.rng))
            if req.pending_first_t is None:
                req.pending_first_t = end
            req.output += 1
            if req.first_token_t is None:
                req.first_token_t = end
                self.fleet.on_first_token(req, end)
            if req.disconnect_at is not None and req.output >= req.disconnect_at:
                self.fleet.on_disconnect(req, end)
                self._finish(req, end, "abort", "client_disconnected")
            elif req.output >= req.target_output:
                capped = req.max_tokens is not None and req.output >= req.max_tokens
                self._finish(req, end, "length" if capped or req.runaway else "stop", None)
            elif len(req.pending_ids) >= sc.tokens_flush:
                self._flush_tokens(req, end)
        running_ids = [req.id for req, _ in plan]
        # Running requests left out of this step (the budget ran out) hold their KV with no progress.
        stalled = [r for r in self.running if r.id not in planned and r.blocks]
        usage = 1.0 - self.free_blocks / sc.kv_blocks
        self.e_step(
            ts,
            self.step_no,
            duration,
            prefill_tokens,
            decode_reqs,
            prefill_reqs,
            decode_reqs,
            len(self.running),
            len(self.waiting),
            min(max(usage, 0.0), 1.0),
            running_ids,
            depth_work,
            max_depth,
            [r.id for r in stalled],
            [r.blocks for r in stalled],
        )
        self.emitted += 1
        self.step_no += 1
        return duration


class SimGateway:
    """Entry and admission: emits gateway events; admits while the fleet has room, else queues."""

    def __init__(self, source_id: str, exporter: Exporter, fleet: Fleet, max_in_flight: int):
        self.id = source_id
        self.fleet = fleet
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        self.emitted = 0
        self.admission: deque[tuple[SimRequest, float]] = deque()
        self.e_arrived = exporter.emitter(Arrived, "ts", "request_id", "endpoint", "stream")
        self.e_enqueued = exporter.emitter(AdmissionEnqueued, "ts", "request_id", "queue_depth", "entry_s")
        self.e_admitted = exporter.emitter(Admitted, "ts", "request_id", "wait_s", "in_flight")
        self.e_first_byte = exporter.emitter(FirstByte, "ts", "request_id", "since_arrived_s")
        self.e_first_token_out = exporter.emitter(FirstTokenOut, "ts", "request_id", "since_arrived_s")
        self.e_completed = exporter.emitter(
            Completed,
            "ts",
            "request_id",
            "status_code",
            "since_arrived_s",
            "finish_reason",
            "last_token_out_s",
        )
        self.e_disconnected = exporter.emitter(
            ClientDisconnected, "ts", "request_id", "since_arrived_s", "last_token_out_s"
        )
        self.e_cut = exporter.emitter(StreamCut, "ts", "request_id", "rule", "command_id")

    def arrive(self, req: SimRequest, t: float, entry_s: float) -> None:
        """The request entered the admission queue at ``t``, having arrived ``entry_s`` earlier."""
        ts = self.fleet.ts
        self.e_arrived(ts(t - entry_s), req.id, "/v1/chat/completions", True)
        self.e_enqueued(ts(t), req.id, len(self.admission), entry_s)
        self.emitted += 2
        self.admission.append((req, t))
        self.admit(t)

    def admit(self, t: float) -> None:
        while self.admission and self.in_flight < self.max_in_flight:
            req, enqueued_t = self.admission.popleft()
            self.in_flight += 1
            self.e_admitted(self.fleet.ts(t), req.id, max(t - enqueued_t, 0.0), self.in_flight)
            self.emitted += 1
            self.fleet.route(req, t)

    def first_token(self, req: SimRequest, t: float) -> None:
        """The engine's first token at ``t``: the response headers, then the token, reach the client
        0.5 ms later (a simulated way back)."""
        self.e_first_byte(self.fleet.ts(t + 0.0004), req.id, t + 0.0004 - req.arrived_t)
        self.e_first_token_out(self.fleet.ts(t + 0.0005), req.id, t + 0.0005 - req.arrived_t)
        self.emitted += 2

    def done(self, req: SimRequest, t: float, reason: str) -> None:
        ts = self.fleet.ts(t + 0.0005)
        since = t + 0.0005 - req.arrived_t
        last = since if req.first_token_t is not None else None  # the last token goes out at the end
        if reason == "abort":
            self.e_disconnected(ts, req.id, since, last)
        elif req.cutoff is not None:
            self.e_cut(ts, req.id, req.cutoff.rule, req.cutoff.id)
            self.emitted += 1
            self.e_completed(ts, req.id, 200, since, "cutoff", last)
        else:
            self.e_completed(ts, req.id, 200, since, reason, last)
        self.emitted += 1
        self.in_flight -= 1
        self.admit(t)


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

    def summary(self) -> dict[str, Any]:
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


def run_simulation(
    *,
    engines: int,
    rps: float,
    duration_s: float,
    ledger_url: str,
    scenario: str = "steady",
    seed: int = 0,
    spool_dir: str | None = None,
    ingest_token: str | None = None,
    model: str = "sim-llama-3-8b",
    source_prefix: str = "sim",
    pace: bool = True,
    overrides: dict[str, Any] | None = None,
    shutdown_timeout_s: float = 30.0,
    drain_timeout_s: float = 120.0,
) -> dict[str, Any]:
    """Run the fleet, wait (up to ``drain_timeout_s``) until every event is acknowledged, spooled ones
    included, shut the exporters down and return the summary.

    The spool folder defaults to the exporter's (``.chunkledger/spool``, or ``CHUNKLEDGER_SPOOL_DIR``):
    one stable folder per source id, so a run that ends with events still spooled (the ledger was down
    past the drain timeout) leaves them for the next run of the same source ids to send.
    """
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; choose from {', '.join(SCENARIOS)}")
    if engines < 1 or rps <= 0 or duration_s <= 0:
        raise ValueError("engines must be >= 1, rps and duration > 0")
    spool_root = spool_dir or os.environ.get("CHUNKLEDGER_SPOOL_DIR") or _DEFAULT_SPOOL_DIR

    def make_exporter(source_id: str, kind: str, on_command: Any) -> Exporter:
        from engine_hooks.exporter import Exporter

        config = ExporterConfig.create(
            url=ledger_url,
            source_id=source_id,
            source_kind=kind,
            model=model if kind == "engine" else None,
            ingest_token=ingest_token,
            spool_dir=os.path.join(spool_root, source_prefix),
            **(overrides or {}),
        )
        return Exporter(config, on_command=on_command)

    fleet = Fleet(
        engines=engines,
        rps=rps,
        scenario=SCENARIOS[scenario],
        seed=seed,
        make_exporter=make_exporter,
        source_prefix=source_prefix,
    )
    started = time.monotonic()
    drained = False
    try:
        lag = fleet.run(duration_s, pace=pace)
        ran = time.monotonic()
        drained = _each(fleet.exporters.values(), lambda ex: ex.force_flush(drain_timeout_s))
        drain_s = time.monotonic() - ran
    finally:
        _each(fleet.exporters.values(), lambda ex: ex.shutdown(shutdown_timeout_s))
    summary = fleet.summary()
    pending = {sid: ex.stats().spool_pending for sid, ex in fleet.exporters.items()}
    summary = {
        "scenario": scenario,
        "seed": seed,
        "engines": engines,
        "rps": rps,
        "duration_s": duration_s,
        "wall_s": round(time.monotonic() - started, 3),
        "lag_s": round(lag, 3),
        **summary,
        # after the run: how long it took until the ledger had acknowledged every event (spooled ones
        # too), and what is still spooled for the next run when it did not within drain_timeout_s
        "drain": {
            "drained": drained,
            "waited_s": round(drain_s, 3),
            "spool_pending": {sid: n for sid, n in pending.items() if n},
            "spool_dir": os.path.abspath(os.path.join(spool_root, source_prefix)),
        },
    }
    return summary


_DEFAULT_SPOOL_DIR = ".chunkledger/spool"


def _each(exporters: Any, call: Callable[[Exporter], bool]) -> bool:
    """``call`` on every exporter at once (each waits on its own ledger traffic); whether all said True."""
    items = list(exporters)
    results = [False] * len(items)

    def run(i: int) -> None:
        results[i] = bool(call(items[i]))

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return all(results)


def simulate(
    engines: Annotated[int, typer.Option(min=1, help="simulated engines")] = 4,
    rps: Annotated[float, typer.Option(min=0.001, help="requests per second for the fleet")] = 20.0,
    duration: Annotated[
        float, typer.Option(min=0.001, help="seconds to simulate (paced to the wall clock)")
    ] = 30.0,
    ledger: Annotated[
        str | None, typer.Option(help="ledger base URL (env CHUNKLEDGER_URL)", envvar="CHUNKLEDGER_URL")
    ] = None,
    scenario: Annotated[str, typer.Option(help=f"one of: {', '.join(SCENARIOS)}")] = "steady",
    seed: Annotated[int, typer.Option(help="random seed; same seed, same events")] = 0,
    spool_dir: Annotated[
        str | None,
        typer.Option(
            help="spool folder of the simulated sources, one subfolder per source id (default: "
            "CHUNKLEDGER_SPOOL_DIR, else .chunkledger/spool): what a run could not deliver is sent by "
            "the next run with the same source ids"
        ),
    ] = None,
    drain_timeout: Annotated[
        float,
        typer.Option(
            min=0, help="after the run, wait up to this many seconds for the ledger to take every event"
        ),
    ] = 120.0,
    ingest_token: Annotated[
        str | None,
        typer.Option(help="ingest token (env CHUNKLEDGER_INGEST_TOKEN)", envvar="CHUNKLEDGER_INGEST_TOKEN"),
    ] = None,
    source_prefix: Annotated[
        str,
        typer.Option(
            help="source ids <prefix>-engine-<i> and <prefix>-gateway-0, request ids "
            "<prefix>-<seed>-req-<n>; use a new prefix (or seed) per run on the same ledger so that the "
            "requests of two runs do not merge"
        ),
    ] = "sim",
) -> None:
    """Emit realistic event streams for N engines and a gateway through the real exporter.

    Prints one JSON line at the end: events emitted and last seq per source, and exporter counters.
    """
    if not ledger:
        typer.echo("error: --ledger (or CHUNKLEDGER_URL) is required", err=True)
        raise typer.Exit(2)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        summary = run_simulation(
            engines=engines,
            rps=rps,
            duration_s=duration,
            ledger_url=ledger,
            scenario=scenario,
            seed=seed,
            spool_dir=spool_dir,
            ingest_token=ingest_token,
            source_prefix=source_prefix,
            drain_timeout_s=drain_timeout,
        )
    except (ValueError, ConfigError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps(summary, sort_keys=False))
    drain = summary["drain"]
    if not drain["drained"]:
        waiting = sum(drain["spool_pending"].values())
        typer.echo(
            f"warning: the ledger had not taken every event {drain_timeout:g} s after the run; "
            f"{waiting} events stay spooled in {drain['spool_dir']} for the next run with source prefix "
            f"{source_prefix!r}",
            err=True,
        )


def main() -> None:  # python -m engine_hooks.simulator
    app = typer.Typer(add_completion=False)
    app.command()(simulate)
    app()


if __name__ == "__main__":
    main()

__all__ = ["SCENARIOS", "Fleet", "Scenario", "run_simulation", "simulate"]
