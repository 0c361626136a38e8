"""The simulated gateway: admission in front of the engines, with the events the real gateway sends."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Protocol

from engine_hooks.events import (
    AdmissionEnqueued,
    Admitted,
    Arrived,
    ClientDisconnected,
    Completed,
    FirstByte,
    FirstTokenOut,
    StreamCut,
)
from engine_hooks.simulation.scenario import SimRequest

if TYPE_CHECKING:
    from engine_hooks.exporter import Exporter


class GatewayHost(Protocol):
    """What the gateway needs of the fleet behind it: its clock, and a way to hand a request on."""

    def ts(self, t: float) -> float:
        """The wall-clock timestamp of virtual time ``t``."""
        ...

    def route(self, req: SimRequest, t: float) -> None:
        """Send an admitted request to an engine at ``t``."""
        ...


class SimGateway:
    """Entry and admission: emits gateway events; admits while the fleet has room, else queues."""

    def __init__(self, source_id: str, exporter: Exporter, fleet: GatewayHost, max_in_flight: int):
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
