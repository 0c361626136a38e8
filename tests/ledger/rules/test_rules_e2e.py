"""End to end: the fleet simulator's runaway scenario against the real ledger service.

Runaways (no token cap, no stop) repeat a 3-token loop until the simulator's 6000-token hard stop. The
ledger's loop rule must cut each one: the command rides back on an ingest response, the simulated engine
aborts the request and confirms with ``cutoff_applied``, and the gateway reports the cut stream.
"""

from __future__ import annotations

import httpx
import pytest
import sqlalchemy as sa

from engine_hooks.simulator import run_simulation
from tests.support.servers import LedgerServer


@pytest.mark.slow
def test_simulated_runaways_are_cut_and_both_sources_confirm(db_url, tmp_path):
    server = LedgerServer(db_url, tmp_path / "ledger.log")
    server.start()
    try:
        summary = run_simulation(
            engines=1,
            rps=12,
            duration_s=6.0,
            ledger_url=server.url,
            scenario="runaway",
            seed=11,
            spool_dir=str(tmp_path / "spool"),
            overrides={"spool_fsync": False, "flush_interval_s": 0.02},
        )
        cut = httpx.get(f"{server.url}/v1/cutoffs", params={"limit": 1000}).json()["cutoffs"]
        metrics = httpx.get(f"{server.url}/metrics").text
    finally:
        server.stop()
    engine = sa.create_engine(db_url)
    with engine.connect() as conn:
        runaways = conn.execute(
            sa.text(
                "SELECT request_id, finish_reason, stop_reason, output_tokens, cut_rule FROM requests "
                "WHERE max_tokens IS NULL AND queued_ts IS NOT NULL"
            )
        ).all()
    engine.dispose()
    assert runaways, "the scenario produced no runaway"
    finished_runaways = [r for r in runaways if r.finish_reason is not None]
    assert finished_runaways
    for r in finished_runaways:
        assert r.finish_reason == "cutoff" and r.stop_reason == "chunkledger:loop", r
        # cut soon after the 128-token detection point: within the flush and one step of the decision
        assert r.output_tokens < 400, r
    loop_cuts = {c["request_id"]: c for c in cut if c["rule"] == "loop"}
    assert {r.request_id for r in finished_runaways} <= set(loop_cuts)
    assert set(loop_cuts) <= {r.request_id for r in runaways}  # no legitimate request was cut
    for r in finished_runaways:
        c = loop_cuts[r.request_id]
        assert c["applied_ts"] is not None and c["applied_source_id"].startswith("sim-engine")
        assert c["decided_ts"] <= c["delivered_ts"] <= c["applied_ts"]
        assert c["gateway_applied_ts"] is not None  # the gateway's stream_cut names the command
        assert c["state"] == "applied"
    assert summary["finished"].get("cutoff", 0) == len(finished_runaways)
    assert f'chunkledger_cutoffs_total{{action="abort",rule="loop"}} {float(len(loop_cuts))}' in metrics
