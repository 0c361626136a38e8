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

import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, TypedDict

from engine_hooks.config import ExporterConfig, ExporterSettings

if TYPE_CHECKING:
    from engine_hooks.exporter import Exporter

from engine_hooks.simulation.fleet import Fleet, FleetSummary
from engine_hooks.simulation.scenario import SCENARIOS, Scenario


class Drain(TypedDict):
    """After the run: whether the ledger acknowledged every event (spooled ones too) within the drain
    timeout, how long that took, and what stays spooled for the next run when it did not."""

    drained: bool
    waited_s: float
    spool_pending: dict[str, int]  # events still spooled, by source id (sources with none left out)
    spool_dir: str


class SimulationSummary(FleetSummary):
    """What :func:`run_simulation` returns (``chunkledger simulate`` prints it as one JSON line)."""

    scenario: str
    seed: int
    engines: int
    rps: float
    duration_s: float
    wall_s: float
    lag_s: float
    drain: Drain


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
    overrides: ExporterSettings | None = None,
    shutdown_timeout_s: float = 30.0,
    drain_timeout_s: float = 120.0,
) -> SimulationSummary:
    """Run the fleet, wait (up to ``drain_timeout_s``) until every event is acknowledged, spooled ones
    included, shut the exporters down and return the summary.

    The spool folder defaults to the exporter's (``.chunkledger/spool``, or ``CHUNKLEDGER_SPOOL_DIR``):
    one stable folder per source id, so a run that ends with events still spooled (the ledger was down
    past the drain timeout) leaves them for the next run of the same source ids to send.

    ``overrides``: exporter settings for every source, but those the fleet sets itself (url, source id
    and kind, model, ingest token, spool folder: its arguments).
    """
    taken = sorted(set(overrides or {}) & set(_FLEET_SETS))
    if taken:
        raise ValueError(f"overrides: the simulator sets {', '.join(taken)} itself (see its arguments)")
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; choose from {', '.join(SCENARIOS)}")
    if engines < 1 or rps <= 0 or duration_s <= 0:
        raise ValueError("engines must be >= 1, rps and duration > 0")
    spool_root = spool_dir or os.environ.get("CHUNKLEDGER_SPOOL_DIR") or _DEFAULT_SPOOL_DIR
    make_exporter = _exporters(
        ledger_url, model, ingest_token, os.path.join(spool_root, source_prefix), overrides or {}
    )
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
    ran_summary = fleet.summary()
    pending = {sid: ex.stats().spool_pending for sid, ex in fleet.exporters.items()}
    summary: SimulationSummary = {
        "scenario": scenario,
        "seed": seed,
        "engines": engines,
        "rps": rps,
        "duration_s": duration_s,
        "wall_s": round(time.monotonic() - started, 3),
        "lag_s": round(lag, 3),
        **ran_summary,
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
# The exporter settings the fleet gives each source itself: not overridden.
_FLEET_SETS = ("url", "source_id", "source_kind", "model", "ingest_token", "spool_dir")


def _exporters(
    ledger_url: str, model: str, ingest_token: str | None, spool_dir: str, overrides: ExporterSettings
) -> Callable[[str, Literal["engine", "gateway"], Any], Exporter]:
    """How the fleet makes each source's exporter: to ``ledger_url``, spooling under ``spool_dir``."""

    def make_exporter(source_id: str, kind: Literal["engine", "gateway"], on_command: Any) -> Exporter:
        from engine_hooks.exporter import Exporter

        settings: ExporterSettings = {
            "url": ledger_url,
            "source_id": source_id,
            "source_kind": kind,
            "model": model if kind == "engine" else None,
            "ingest_token": ingest_token,
            "spool_dir": spool_dir,
            **overrides,
        }
        return Exporter(ExporterConfig.create(**settings), on_command=on_command)

    return make_exporter


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


__all__ = ["SCENARIOS", "Fleet", "Scenario", "run_simulation"]
