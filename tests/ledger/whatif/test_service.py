"""What-if over a real ledger: the simulator's runs stored by ``chunkledger serve``, replayed from the
database (``ledger.whatif.service``), through ``GET /v1/whatif`` and through ``chunkledger whatif``.

The simulator (``engine_hooks.simulation``) schedules like vLLM v1 with a step time linear in the fit's
terms, so the replay of its recorded setting must give back its measured tails, and a prediction for
another setting must match a second run of the same requests under that setting.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from chunkledger.main import app as cli_app
from engine_hooks.scheduling.settings import EngineSettings
from engine_hooks.simulation.scenario import SCENARIOS
from engine_hooks.simulator import run_simulation
from ledger.advice.fit import fit_step_time
from ledger.advice.query import read_steps
from ledger.analytics.itl import decode_itl
from ledger.app import create_app
from ledger.config import Settings
from ledger.store import open_store
from ledger.whatif.answer import WhatIf, WhatIfError
from ledger.whatif.cost import fitted_cost
from ledger.whatif.noise import StepNoise, draws_for
from ledger.whatif.query import WhatIfQuery, candidates_from, parse_setting, setting_text
from ledger.whatif.results import weighted_quantile
from ledger.whatif.service import MIN_REQUESTS, pooled_replay, what_if
from ledger.whatif.trace import Recorded, arrival_of, read_recorded
from ledger.whatif.types import StepShape, TraceRequest
from tests.support.servers import LedgerServer

# the simulator's long-prompts engine: budget 2048, 256 seqs, 16,384 blocks of 16 tokens; it admits a
# request when its prompt fits the free KV (not its whole sequence: vLLM's reserve_full_isl off)
SIM_SETTINGS = "num_kv_blocks=16384,max_num_seqs=256,reserve_full_isl=false"
TOKENS = {"ingest_token": "ing", "read_token": "rd", "admin_token": "adm"}
RD = {"Authorization": "Bearer rd"}
runner = CliRunner()


def simulate(db_url: str, tmp: Path, name: str, scenario: str = "long-prompts", **changes: Any) -> None:
    """One simulated engine, 40 s of traffic at 8 requests/s (seed 3), stored by a real ledger."""
    if changes:
        SCENARIOS[f"test-{name}"] = dataclasses.replace(SCENARIOS[scenario], **changes)
        scenario = f"test-{name}"
    server = LedgerServer(db_url, tmp / f"{name}.log")
    server.start()
    try:
        summary = run_simulation(
            engines=1,
            rps=8,
            duration_s=40,
            ledger_url=server.url,
            scenario=scenario,
            seed=3,
            pace=False,
            source_prefix="sim",
            spool_dir=str(tmp / f"spool-{name}"),
        )
        assert summary["requests"] > 250 and not summary["exporter"]["dropped"]
    finally:
        server.stop()
        SCENARIOS.pop(f"test-{name}", None)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """DuckDB files: the long-prompts scene as simulated (budget 2048, no threshold), the same requests
    with long_prefill_token_threshold=256, and an engine short of KV cache (preemptions)."""
    tmp = tmp_path_factory.mktemp("whatif")
    urls = {name: f"duckdb:///{tmp / name}.duckdb" for name in ("recorded", "threshold", "kv")}
    # no runaways: their cutoffs reach the simulator at a moment that depends on the machine, so two
    # runs of the same requests would not do the same work
    simulate(urls["recorded"], tmp, "recorded", runaway_p=0.0)
    simulate(urls["threshold"], tmp, "threshold", runaway_p=0.0, long_prefill_token_threshold=256)
    simulate(urls["kv"], tmp, "kv", scenario="kv-pressure")
    return urls


def answer(
    db_url: str,
    *,
    candidates: list[dict[str, Any]],
    recorded: dict[str, Any] | None = None,
    min_requests: int = MIN_REQUESTS,
    **params: Any,
) -> dict[str, Any]:
    """:func:`what_if` of these settings (parsed), its answer as JSON would give it."""
    engine = sa.create_engine(db_url, connect_args={"read_only": True} if db_url.startswith("duckdb") else {})
    query = WhatIfQuery(recorded=setting_text(recorded) if recorded else None, **params)
    try:
        out = msgspec.to_builtins(what_if(engine, query, candidates=candidates, min_requests=min_requests))
    finally:
        engine.dispose()
    assert isinstance(out, dict)
    return out


RECORDED = parse_setting(SIM_SETTINGS)


def test_replaying_the_recorded_setting_gives_back_the_measured_tails(runs):
    out = answer(runs["recorded"], candidates=[{"max_num_batched_tokens": 512}], recorded=RECORDED)
    cal = out["calibration"]
    assert out["window"]["requests"] > 250 and out["fit"]["r2"] > 0.999
    assert cal["inferred"] == ["max_num_batched_tokens", "enable_chunked_prefill"]
    assert cal["settings"]["max_num_batched_tokens"] == 2048 and cal["settings"]["enable_chunked_prefill"]
    for tail in ("ttft_p99_s", "e2e_p99_s", "short_ttft_p99_s", "long_ttft_max_s"):
        assert abs(cal["error"][tail]) < 0.01, (tail, cal)
    # the ledger's ITL is read off step intervals in 0.5 % bins, the replay's off its own steps
    assert abs(cal["error"]["itl_p99_s"]) < 0.15, cal
    assert cal["max_error"] < 0.15
    # the simulator's steps take exactly their modelled time: the window's noise is a factor of 1
    noise = out["step_noise"]
    assert noise["applied"] and noise["decode_steps"] > 500
    assert noise["p50"] == pytest.approx(1.0, abs=0.01) and noise["p99"] < 1.05
    # the simulator's engines go from step to step at once: no engine-loop time between them
    assert noise["loop_ms"]["decode"]["p99"] < 0.01 and noise["loop_ms"]["per_first_token"] < 0.001
    # a window of a few hundred requests is replayed in several noise draws, pooled
    assert noise["draws"] == draws_for(out["window"]["requests"]) > 1
    assert cal["predicted"]["requests"] == out["window"]["requests"]  # per draw, not pooled
    off = answer(runs["recorded"], candidates=[], recorded=RECORDED, step_noise=False)
    assert off["step_noise"] == {"applied": False, "why": "off"}


def test_noise_draws_are_pooled_into_the_tails_and_a_long_requests_median() -> None:
    def cost(shape: StepShape) -> float:
        return 0.002 + 1e-6 * shape.prefill_tokens + 1e-4 * shape.num_decode_reqs

    reqs = {"e0": [TraceRequest(f"r{k}", 0.02 * k, 4000 if k == 10 else 64, 0, 40) for k in range(60)]}
    settings = EngineSettings(512, 64, 4000)
    noise = StepNoise([1.0] * 9 + [4.0], decode_gaps=[0.0] * 9 + [0.003])
    one = [pooled_replay(reqs, settings, cost, noise.reseeded(d)) for d in range(4)]
    pooled = pooled_replay(reqs, settings, cost, noise, draws=4)
    assert [p.ttft_s.tolist() for p in one] == pooled.ttft_s.reshape(4, 60).tolist()  # seeds 0..3
    summary = pooled.summary(long_prompt_tokens=1000)
    assert summary["requests"] == 60 and summary["steps"] == sum(p.steps for p in one) // 4
    # the long request's TTFT: its median over the draws, not the worst of them
    assert summary["long_ttft_s"] == [pytest.approx(float(np.median([p.ttft_s[10] for p in one])))]
    pooled_gaps = np.concatenate([p.itl_gap_s for p in one])
    pooled_counts = np.concatenate([p.itl_count for p in one])
    assert summary["itl_p99_s"] == weighted_quantile(pooled_gaps, pooled_counts, 0.99)
    with pytest.raises(ValueError, match="draws must be 1"):
        pooled_replay(reqs, settings, cost, None, draws=2)


def test_a_small_window_is_replayed_in_more_draws_than_a_large_one() -> None:
    assert draws_for(160) == 32  # at most 32
    assert draws_for(1_000) == 5
    assert draws_for(50_000) == draws_for(5_000) == 1


def recorded_window(db_url: str) -> tuple[Recorded, Any]:
    engine = sa.create_engine(db_url, connect_args={"read_only": True})
    try:
        steps = read_steps(engine)
        with engine.connect() as conn:
            rec = read_recorded(conn, model=steps.model, source_ids=steps.source_ids, since=None, until=None)
        return rec, fit_step_time(steps.data)
    finally:
        engine.dispose()


def test_a_predicted_setting_matches_a_run_under_that_setting(runs):
    """Predicted from the first run, for long_prefill_token_threshold=256; measured in a second run of
    the same requests (same seed: same ids and arrivals) under that setting. Compared request by
    request over the requests both runs finished (the runs end mid-traffic, and which of the last
    requests finish depends on the setting)."""
    asked = {"long_prefill_token_threshold": 256}
    first, fit = recorded_window(runs["recorded"])
    settings = EngineSettings(max_num_batched_tokens=2048, **RECORDED, **asked)
    predicted = pooled_replay(first.requests, settings, fitted_cost(fit))
    second, _ = recorded_window(runs["threshold"])
    ids = [r.request_id for rs in second.requests.values() for r in rs]
    out = [r.output_tokens for rs in second.requests.values() for r in rs]
    at = {rid: i for i, rid in enumerate(predicted.request_id)}
    tokens = {r.request_id: r.output_tokens for rs in first.requests.values() for r in rs}
    both = [k for k, rid in enumerate(ids) if rid in at]
    assert all(tokens[ids[k]] == out[k] for k in both)  # the same work in both runs
    assert len(both) > 0.95 * len(ids)
    pick = np.array([at[ids[k]] for k in both])
    for name, want, got in (
        ("ttft", second.ttft_s[both], predicted.ttft_s[pick]),
        ("e2e", second.e2e_s[both], predicted.e2e_s[pick]),
    ):
        for q in (0.5, 0.9, 0.99):
            assert np.quantile(got, q) == pytest.approx(np.quantile(want, q), rel=0.03), (name, q)
        assert np.median(np.abs(got - want)) < 0.005, name  # request by request, within 5 ms
    # and the threshold does what it is for: short requests' TTFT down, the long prompts' up
    long = second.prompt_tokens[both] >= 4096
    before = {r.request_id: i for i, r in enumerate(x for rs in first.requests.values() for x in rs)}
    was = first.ttft_s[[before[ids[k]] for k in both]]
    assert np.quantile(second.ttft_s[both][~long], 0.99) < 0.6 * np.quantile(was[~long], 0.99)
    assert second.ttft_s[both][long].max() > 1.5 * was[long].max()


def test_a_sweep_marks_the_frontier_and_the_best_setting_meeting_the_targets(runs):
    sweep = candidates_from(sweep="max_num_batched_tokens=256,512,1024,4096")
    out = answer(runs["recorded"], candidates=sweep, recorded=RECORDED, itl_target_ms=20.0)
    rows = {r["name"]: r for r in out["candidates"]}
    assert list(rows) == [f"max_num_batched_tokens={b}" for b in (256, 512, 1024, 4096)]
    itl = [rows[n]["predicted"]["itl_p99_s"] for n in rows]
    assert itl == sorted(itl)  # a bigger budget: longer steps between a decode's tokens
    meets = {n: r["meets"]["itl"] for n, r in rows.items()}
    assert meets == {n: r["predicted"]["itl_p99_s"] * 1e3 <= 20.0 for n, r in rows.items()}
    best = [n for n, r in rows.items() if r["best"]]
    ok = [n for n in rows if meets[n]]
    assert best == [min(ok, key=lambda n: rows[n]["predicted"]["short_ttft_p99_s"])]
    assert all(r["frontier"] for r in rows.values())  # a trade-off: each wins somewhere
    assert rows["max_num_batched_tokens=512"]["relative"]["short_ttft_p99_s"] > 0


def test_a_window_with_preemptions_needs_the_kv_cache_size(runs):
    with pytest.raises(WhatIfError) as err:
        answer(runs["kv"], candidates=[{"max_num_batched_tokens": 512}])
    assert err.value.reason == "recorded_setting_needed" and "num_kv_blocks" in str(err.value)
    out = answer(
        runs["kv"],
        candidates=[{"policy": "kv-idle"}],
        recorded={"num_kv_blocks": 2048, "max_num_seqs": 256, "reserve_full_isl": False},
        force=True,
    )
    assert out["calibration"]["measured"]["preemptions"] > 0
    assert out["calibration"]["predicted"]["preemptions"] > 0


def test_a_large_calibration_error_is_refused_with_the_figures(runs):
    wrong = {**RECORDED, "max_num_batched_tokens": 256}  # not what the engine ran
    with pytest.raises(WhatIfError) as err:
        answer(runs["recorded"], candidates=[{"max_num_batched_tokens": 512}], recorded=wrong)
    assert err.value.reason == "calibration_failed" and err.value.status == 409
    cal = err.value.details["calibration"]
    assert cal["max_error"] > 0.25 and cal["settings"]["max_num_batched_tokens"] == 256
    forced = answer(
        runs["recorded"], candidates=[{"max_num_batched_tokens": 512}], recorded=wrong, force=True
    )
    assert forced["calibration"]["max_error"] == cal["max_error"]


def test_too_few_requests_are_refused(runs):
    with pytest.raises(WhatIfError) as err:
        answer(runs["recorded"], candidates=[{"max_num_batched_tokens": 512}], min_requests=100_000)
    assert err.value.reason == "too_little_data" and err.value.status == 409


def test_read_steps_gives_each_steps_predecessors_prefill_requests_on_request(runs):
    engine = sa.create_engine(runs["recorded"], connect_args={"read_only": True})
    try:
        window = read_steps(engine, previous_prefills=True)
        assert read_steps(engine).prev_prefill_reqs is None  # the advice's read is unchanged
        with engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT num_prefill_reqs FROM steps ORDER BY step")).all()
    finally:
        engine.dispose()
    prefills = [float(r[0]) for r in rows]
    previous = [0.0, *prefills[:-1]]  # one engine: newest first, as read_steps reads
    assert window.prev_prefill_reqs is not None and len(window.prev_prefill_reqs) == len(rows) > 1000
    assert window.prev_prefill_reqs.tolist() == previous[::-1]
    assert sum(previous) > 100  # the scene has prefills to lag


def test_the_fitted_cost_is_the_fits_prediction(runs):
    engine = sa.create_engine(runs["recorded"], connect_args={"read_only": True})
    window = read_steps(engine)
    engine.dispose()
    fit = fit_step_time(window.data)
    cost = fitted_cost(fit, floor_s=0.0)
    d = window.data
    shapes = [
        StepShape(*(int(getattr(d, c)[i]) for c in list(StepShape._fields)[:5]), float(d.kv_usage[i]))
        for i in range(0, len(d), 37)
    ]
    got = np.array([cost(s) for s in shapes])
    want = fit.predict(d.select(np.arange(len(d)) % 37 == 0))
    np.testing.assert_allclose(got, want, rtol=1e-9)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("max_num_batched_tokens", "not key=value"),
        ("chunk=512", "unknown setting 'chunk'"),
        ("max_num_batched_tokens=lots", "max_num_batched_tokens='lots' is not a int"),
        ("enable_chunked_prefill=maybe", "enable_chunked_prefill='maybe' is not a bool"),
        ("policy=random", "unknown policy 'random' (known: fcfs, priority, kv-idle)"),
        ("", "empty"),
    ],
)
def test_a_bad_setting_names_the_key_and_why(text, words):
    with pytest.raises(WhatIfError) as err:
        parse_setting(text)
    assert words in str(err.value) and err.value.status == 422


def test_asked_settings_from_set_sweep_and_policy():
    assert candidates_from(["max_num_batched_tokens=512,long_prefill_token_threshold=128"]) == [
        {"max_num_batched_tokens": 512, "long_prefill_token_threshold": 128}
    ]
    assert candidates_from(sweep="admission_reserve=0.1,0.25") == [
        {"admission_reserve": 0.1},
        {"admission_reserve": 0.25},
    ]
    assert candidates_from(["max_num_batched_tokens=512"], policy="kv-idle") == [
        {"max_num_batched_tokens": 512, "policy": "kv-idle"}
    ]
    assert candidates_from(policy="priority") == [{"policy": "priority"}]
    for bad in ({}, {"policy": "random"}, {"sets": ["max_num_seqs=1"] * 33}):
        with pytest.raises(WhatIfError):
            candidates_from(**bad)


def test_a_setting_that_needs_steps_the_fit_never_saw_is_flagged_and_never_best(runs):
    unchunked = {"enable_chunked_prefill": False, "max_num_batched_tokens": 32768}
    out = answer(
        runs["recorded"], candidates=[unchunked, {"max_num_batched_tokens": 1024}], recorded=RECORDED
    )
    flagged, inside = out["candidates"]
    assert len(flagged["extrapolated"]) == 1 and flagged["extrapolated"][0].startswith(
        "prefill tokens per step"
    )
    assert "the fit's steps: up to 2,04" in flagged["extrapolated"][0]
    assert inside["extrapolated"] == [] and inside["best"] and not flagged["best"]


def test_arrival_is_the_engines_front_end_time_unless_it_is_missing_or_after_the_queue():
    # vLLM queues a request that came during a step only after the step: that wait is the replay's too
    assert arrival_of(100.0, 99.2) == 99.2
    assert arrival_of(100.0, None) == 100.0
    assert arrival_of(100.0, 100.5) == 100.0  # clocks disagree: never after the queue


def test_the_measured_itl_is_the_replayed_engines_own(runs):
    engine = sa.create_engine(runs["kv"], connect_args={"read_only": True})
    try:
        with engine.connect() as conn:
            everyone = decode_itl(conn)[0]
            (sid,) = [
                r[0] for r in conn.execute(sa.text("SELECT source_id FROM sources WHERE kind = 'engine'"))
            ]
            own = read_recorded(conn, model=None, source_ids=[sid], since=None, until=None).itl
            nobody = read_recorded(conn, model=None, source_ids=["nobody"], since=None, until=None).itl
    finally:
        engine.dispose()
    assert own == everyone  # one engine: the same tails as the ledger's ITL
    assert nobody is None


def engine_source(db_url: str) -> str:
    engine = sa.create_engine(db_url, connect_args={"read_only": True})
    try:
        with engine.connect() as conn:
            (sid,) = [
                r[0] for r in conn.execute(sa.text("SELECT source_id FROM sources WHERE kind = 'engine'"))
            ]
        return sid
    finally:
        engine.dispose()


def test_the_step_time_can_be_fitted_on_another_engines_steps(runs):
    asked = [{"max_num_batched_tokens": 512}]
    own = answer(runs["recorded"], candidates=asked, recorded=RECORDED)
    sid = engine_source(runs["recorded"])
    same = answer(runs["recorded"], candidates=asked, recorded=RECORDED, fit_source=sid)
    assert same["fit"]["source_ids"] == [sid] and same["fit"]["steps"] == own["fit"]["steps"]
    assert same["candidates"][0]["predicted"] == own["candidates"][0]["predicted"]
    with pytest.raises(WhatIfError) as err:
        answer(runs["recorded"], candidates=asked, recorded=RECORDED, fit_source="profile-nobody")
    assert err.value.reason == "unknown_source" and err.value.status == 404
    with pytest.raises(WhatIfError) as err:
        answer(runs["recorded"], candidates=asked, recorded=RECORDED, fit_since="2100-01-01T00:00:00Z")
    assert err.value.status == 409  # no step in that window to fit on


class _QuadraticCost:
    """A profile engine's step cost with attention inside the chunk (tokens²)."""

    PER_TOKEN2 = 1.8e-9

    def cost_s(self, tokens: float, depth: float, decodes: float) -> float:
        return 1.5e-3 + 5e-6 * tokens + 4e-9 * tokens * depth + 4e-5 * decodes + self.PER_TOKEN2 * tokens**2


def test_the_attention_inside_a_chunk_can_come_from_a_profile(runs, tmp_path):
    from engine_hooks import events as ev
    from tools.synthetic_steps import synthetic_steps

    src = Path(runs["recorded"].removeprefix("duckdb:///"))
    url = f"duckdb:///{tmp_path / 'with-profile.duckdb'}"
    for suffix in ("", ".wal"):
        if Path(f"{src}{suffix}").exists():
            Path(f"{tmp_path / 'with-profile.duckdb'}{suffix}").write_bytes(
                Path(f"{src}{suffix}").read_bytes()
            )
    profile = synthetic_steps(
        _QuadraticCost(),
        n=800,
        chunk_sizes=tuple(size for size in (256, 1024, 4096, 8192, 16384) for _ in range(16384 // size)),
        max_depth=32768,
        decode_batches=(1, 4, 8),
        t0=1_600_000_000.0,  # long before the window: only the fit reads these
    )
    store = open_store(url)
    try:
        source = ev.Source(id="profile-x", kind="engine", model="profiled")
        for i in range(0, len(profile), 400):
            store.write([ev.Batch(source=source, events=profile[i : i + 400])])
    finally:
        store.close()
    asked = [{"max_num_batched_tokens": 8192}]
    sid = engine_source(runs["recorded"])
    plain = answer(url, candidates=asked, recorded=RECORDED, source_id=sid)
    with_attention = answer(
        url, candidates=asked, recorded=RECORDED, source_id=sid, attention_source="profile-x"
    )
    att = with_attention["fit"]["attention"]
    assert att["source_id"] == "profile-x" and att["prefill_tokens"][1] == 16384
    assert att["ms_per_token2_per_chunk"] == pytest.approx(_QuadraticCost.PER_TOKEN2 * 1e3, rel=0.15)
    assert "prefill_tokens_sq" not in with_attention["fit"]["terms"]  # the rest from the window
    assert plain["fit"]["attention"] is None
    # 8k-token chunks cost more once the attention inside them is counted
    more = with_attention["candidates"][0]["predicted"]["long_ttft_max_s"]
    assert more > 1.05 * plain["candidates"][0]["predicted"]["long_ttft_max_s"]
    with pytest.raises(WhatIfError) as err:  # the simulator's steps have no such cost
        answer(url, candidates=asked, recorded=RECORDED, source_id=sid, attention_source=sid)
    assert err.value.reason == "attention_not_measured" and err.value.status == 409
    with pytest.raises(WhatIfError) as err:
        answer(url, candidates=asked, recorded=RECORDED, source_id=sid, attention_source="profile-nobody")
    assert err.value.reason == "unknown_source" and err.value.status == 404


# -- through the API and the command line -----------------------------------------------------------
@pytest.fixture(scope="module")
def api(runs) -> Iterator[TestClient]:
    store = open_store(runs["recorded"])
    with TestClient(create_app(Settings(db_url=runs["recorded"], **TOKENS), store=store)) as c:
        yield c
    store.close()


def test_the_endpoint_answers_a_sweep(api):
    params = {"sweep": "max_num_batched_tokens=512,1024", "recorded": SIM_SETTINGS, "itl_target_ms": "25"}
    r = api.get("/v1/whatif", params=params, headers=RD)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["name"] for c in body["candidates"]] == [
        "max_num_batched_tokens=512",
        "max_num_batched_tokens=1024",
    ]
    assert body["calibration"]["max_error"] < 0.15 and body["targets"]["itl_p99_ms"] == 25


@pytest.mark.parametrize(
    ("params", "status", "reason", "words"),
    [
        ({"set": "chunk=1"}, 422, "bad_setting", "unknown setting 'chunk'"),
        ({"policy": "random"}, 422, "bad_setting", "policy"),
        ({}, 422, "nothing_asked", "set, sweep or policy"),
        ({"set": "max_num_seqs=0"}, 422, "bad_setting", "max_num_seqs"),
        ({"set": "max_num_seqs=8", "since": "yesterday"}, 422, "bad_time", "yesterday"),
        ({"set": "max_num_seqs=8", "model": "nobody"}, 404, "unknown_model", "nobody"),
    ],
)
def test_the_endpoint_refuses_with_a_reason_naming_the_field(api, params, status, reason, words):
    r = api.get("/v1/whatif", params={"recorded": SIM_SETTINGS, **params}, headers=RD)
    assert r.status_code == status, r.text
    assert r.json()["reason"] == reason and words in r.json()["detail"]


def test_the_endpoint_needs_the_read_token(api):
    assert api.get("/v1/whatif", params={"set": "max_num_seqs=8"}).status_code == 401


def test_the_command_prints_measured_replayed_and_asked_side_by_side(runs):
    # (the threshold run's file: the API tests' app holds the recorded one open in this process)
    args = [
        "whatif",
        "--db",
        runs["threshold"],
        "--recorded",
        SIM_SETTINGS + ",long_prefill_token_threshold=256",
    ]
    res = runner.invoke(
        cli_app, [*args, "--sweep", "max_num_batched_tokens=512,1024", "--itl-target-ms", "25"]
    )
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert any(line.startswith("measured ") for line in lines)
    assert any(line.startswith("recorded, replayed (error)") for line in lines)
    assert any(line.startswith("max_num_batched_tokens=512 ") and "itl" in line for line in lines)
    noise = next(line for line in lines if line.startswith("step noise: "))
    assert "engine loop before a step" in noise and "draws pooled" in noise  # a small window: draws
    quiet = runner.invoke(cli_app, [*args, "--set", "max_num_seqs=64", "--no-step-noise"])
    assert quiet.exit_code == 0 and "step noise: none (off)" in quiet.output
    fitted = runner.invoke(cli_app, [*args, "--set", "max_num_seqs=64", "--fit-since", "0"])
    assert fitted.exit_code == 0 and " steps of sim-" in fitted.output  # the fit's steps, named
    js = runner.invoke(cli_app, [*args, "--set", "max_num_seqs=64", "--format", "json"])
    assert js.exit_code == 0 and json.loads(js.output)["candidates"][0]["settings"]["max_num_seqs"] == 64


def test_the_command_exits_1_with_the_calibration_when_refused(runs):
    res = runner.invoke(
        cli_app, ["whatif", "--db", runs["threshold"], "--set", "max_num_seqs=64", "--max-error", "0"]
    )
    assert res.exit_code == 1
    assert "no what-if (calibration_failed)" in res.output and "replayed" in res.output


# -- the answer's schema and the query ----------------------------------------------------------------
def _whatif_schema(api: TestClient) -> dict[str, Any]:
    doc = api.get("/openapi.json").json()
    ok = doc["paths"]["/v1/whatif"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    return {**ok, "components": doc["components"]}


def test_the_endpoints_answers_validate_against_its_published_schema(api):
    import jsonschema

    schema = _whatif_schema(api)
    validator = jsonschema.Draft202012Validator(schema)
    asked = [
        {  # targets met or missed, an unchunked setting outside the fit's data, a sweep
            "sweep": "max_num_batched_tokens=512,1024",
            "set": "enable_chunked_prefill=false,max_num_batched_tokens=32768",
            "itl_target_ms": "25",
            "ttft_target_ms": "500",
        },
        {"policy": "kv-idle", "step_noise": "false"},  # no targets, no step noise
    ]
    for params in asked:
        r = api.get("/v1/whatif", params={"recorded": SIM_SETTINGS, **params}, headers=RD)
        assert r.status_code == 200, r.text
        body = r.json()
        validator.validate(body)
        assert msgspec.json.decode(r.content, type=WhatIf) == msgspec.convert(body, WhatIf)
    assert body["step_noise"] == {"applied": False, "why": "off"} and body["candidates"][0]["meets"] is None
    # the schema is closed: an answer with a key it does not describe, or without one, is not valid
    extra = {**body, "calibration": {**body["calibration"], "surprise": 1}}
    assert not validator.is_valid(extra)
    missing = {k: v for k, v in body.items() if k != "fit"}
    assert not validator.is_valid(missing)


def test_the_answers_schema_describes_every_record_closed(api):
    schemas = api.get("/openapi.json").json()["components"]["schemas"]
    answer = api.get("/openapi.json").json()["paths"]["/v1/whatif"]["get"]["responses"]["200"]
    assert answer["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/WhatIf"}
    names, todo = set(), ["WhatIf"]
    while todo:  # every record the answer refers to, directly or not
        name = todo.pop()
        if name not in names:
            names.add(name)
            todo += [ref.rsplit("/", 1)[1] for ref in _refs(schemas[name])]
    records = {name: schemas[name] for name in names}
    assert {"WhatIf", "ReplayTails", "Candidate", "Settings"} <= set(records)
    for name, schema in records.items():
        assert schema["type"] == "object" and schema["additionalProperties"] is False, name
        for field, prop in schema["properties"].items():
            assert prop != {} and prop.get("additionalProperties") is not True, (name, field)


def _refs(schema: object) -> list[str]:
    if isinstance(schema, dict):
        return [schema["$ref"]] if "$ref" in schema else [r for v in schema.values() for r in _refs(v)]
    if isinstance(schema, list):
        return [r for v in schema for r in _refs(v)]
    return []


def test_the_endpoints_parameters_are_the_query_objects_fields(api):
    doc = api.get("/openapi.json").json()
    params = {p["name"]: p for p in doc["paths"]["/v1/whatif"]["get"]["parameters"]}
    assert list(params) == list(WhatIfQuery.__struct_fields__)
    assert params["max_error"]["schema"]["default"] == WhatIfQuery().max_error == 0.25
    assert params["long_prompt_tokens"]["schema"]["anyOf"][0]["minimum"] == 1
    assert params["set"]["schema"]["maxItems"] == 32
    r = api.get("/v1/whatif", params={"set": "max_num_seqs=8", "long_prompt_tokens": "0"}, headers=RD)
    assert r.status_code == 422 and r.json()["reason"] == "invalid"
    assert "long_prompt_tokens" in r.json()["detail"]


def test_a_query_out_of_its_limits_is_refused_naming_the_field():
    with pytest.raises(WhatIfError) as err:
        WhatIfQuery(set=["max_num_seqs=8"], max_error=-1.0).checked()
    assert err.value.status == 422 and err.value.reason == "invalid"
    assert str(err.value).startswith("max_error: ") and ">= 0" in str(err.value)
    ok = WhatIfQuery(set=["max_num_seqs=8"], since="15m")
    assert ok.checked() == ok
    assert ok.params()["set"] == ["max_num_seqs=8"] and ok.params()["since"] == "15m"


def test_a_settings_text_reads_back_as_the_same_settings():
    values = {"max_num_batched_tokens": 512, "enable_chunked_prefill": False, "admission_reserve": 0.1}
    assert parse_setting(setting_text(values)) == values
