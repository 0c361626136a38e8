"""``chunkledger profile``: the plan, the in-process recorder, and a tiny profile on real vLLM (CPU)."""

from __future__ import annotations

import json
import os
import random
import sys
import types

import httpx
import msgspec
import numpy as np
import pytest
from typer.testing import CliRunner

from chunkledger.main import app as cli_app
from engine_hooks import events as ev
from engine_hooks.profile_run import Delivery, Phase, ProfileRun
from engine_hooks.vllm.cpu import EngineSettings
from engine_hooks.vllm.profile import EngineKwargs, StepRecorder, _delivered, _start_engine
from ledger.advice.answer import Advice
from ledger.advice.profile import ProfileError, ProfilePlan, ProfileResult, theil_sen
from ledger.advice.report import render_profile
from ledger.records import as_json

runner = CliRunner()


@pytest.mark.parametrize(
    ("plan", "words"),
    [
        (ProfilePlan(chunk_sizes=(64, 128)), "at least 3 different sizes"),
        (ProfilePlan(chunk_sizes=(64, 128, 256), max_depth=300), "at least twice the largest chunk"),
        (ProfilePlan(decode_batches=(4,)), "at least 2 different decode batches"),
        (ProfilePlan(chunk_sizes=(0, 64, 128)), "sizes >= 1"),
        (ProfilePlan(repeats=0), "must be >= 1"),
    ],
)
def test_profile_plan_refuses_plans_the_fit_cannot_use(plan, words):
    with pytest.raises(ProfileError, match=words):
        plan.check()


def test_profile_plan_sizes_the_engine_for_its_first_step_and_deepest_chunk():
    plan = ProfilePlan(chunk_sizes=(256, 512, 2048), max_depth=8192, decode_batches=(1, 32))
    assert plan.max_num_batched_tokens == 2048 + 32 * plan.decode_prompt_tokens
    assert plan.max_model_len >= 8192 + 2048
    # decoders outlast the chunked prefill (8192 + 256 tokens: 33 chunks of 256) plus the tail
    assert plan.decode_tokens_for(256) == 33 + plan.tail_steps + 2


def test_recorder_keeps_steps_forwards_everything_and_is_silent_while_paused():
    class Forward:
        def __init__(self):
            self.sent = []

        def emitter(self, kind, *fields):
            return lambda *values: self.sent.append((kind, values))

    fwd = Forward()
    rec = StepRecorder(fwd)
    step = rec.emitter(ev.Step, "ts", "step", "duration_s", "prefill_tokens", "max_prefill_depth")
    queued = rec.emitter(ev.Queued, "ts", "request_id", "prompt_tokens")
    rec.paused = True
    step(1.0, 0, 0.01, 64, 0)
    rec.paused = False
    step(2.0, 1, 0.02, 64, 64)
    step.many([(3.0, 2, 0.03, 64, 128)])
    queued(2.5, "r1", 300)
    assert [(s.step, s.seq, s.prefill_tokens, s.max_prefill_depth) for s in rec.steps] == [
        (1, 1, 64, 64),
        (2, 2, 64, 128),
    ]
    assert [k for k, _ in fwd.sent] == [ev.Step, ev.Step, ev.Queued]


def test_a_run_of_the_driver_becomes_the_ledgers_tables_per_chunk_and_decode_batch():
    """The driver's run (engine_hooks.vllm.profile.ProfileRun) is what ProfileResult reads: per phase,
    the chunk steps give the step time at depth 0 and per 1k tokens of depth."""
    plan = ProfilePlan(chunk_sizes=(64, 128, 256), max_depth=512, decode_batches=(1, 4))
    steps: list[ev.Step] = []
    phases: list[Phase] = []
    for batch in plan.decode_batches:
        for chunk in plan.chunk_sizes:
            first = len(steps)
            for depth in range(0, plan.max_depth + 1, chunk):  # 2 ms + 10 us a token + 1 ms per 1k depth
                ms = 2.0 + 0.01 * chunk + 0.1 * batch + depth / 1000.0
                steps.append(_step(len(steps), ms, chunk, depth, batch))
            for _ in range(plan.tail_steps):
                steps.append(_step(len(steps), 2.0 + 0.1 * batch, 0, 0, batch))
            phases.append(Phase(chunk, batch, first, len(steps), wall_s=0.5))
    run = ProfileRun(model="tiny", steps=steps, phases=phases, source_id="profile-tiny", sent={"sent": 1})
    result = ProfileResult.of(plan, run)
    assert (result.model, result.source_id, len(result.steps)) == ("tiny", "profile-tiny", len(steps))
    rows = {(r["chunk_tokens"], r["decode_batch"]): r for r in as_json(result.chunk_table())}
    assert set(rows) == {(c, b) for c in plan.chunk_sizes for b in plan.decode_batches}
    for (chunk, batch), row in rows.items():
        assert row["ms_at_depth_0"] == pytest.approx(2.0 + 0.01 * chunk + 0.1 * batch)
        assert row["ms_per_1k_depth"] == pytest.approx(1.0)
        assert row["max_depth"] == plan.max_depth
    decode = {r["decode_batch"]: r["p50_ms"] for r in as_json(result.decode_table())}
    assert decode == pytest.approx({1: 2.1, 4: 2.4})
    report = as_json(result.report())
    assert report["wall_s"] == pytest.approx(0.5 * len(phases)) and report["ledger"] == {"sent": 1}


def _step(i: int, ms: float, chunk: int, depth: int, decodes: int) -> ev.Step:
    return ev.Step(
        seq=i + 1,
        ts=1000.0 + i,
        step=i,
        duration_s=ms / 1e3,
        prefill_tokens=chunk,
        num_prefill_reqs=1 if chunk else 0,
        num_decode_reqs=decodes,
        decode_tokens=decodes,
        max_prefill_depth=depth,
        prefill_depth_tokens=chunk * depth,
    )


def _noisy_run(plan: ProfilePlan, sent: Delivery | None) -> ProfileRun:
    """A run of ``plan`` whose steps cost 2 ms + 10 us a token + 0.1 ms a decode + 1 ms per 1k depth, 3 %
    noise (enough steps for the fit)."""
    rng = random.Random(0)
    steps: list[ev.Step] = []
    phases: list[Phase] = []
    for batch in plan.decode_batches:
        for chunk in plan.chunk_sizes:
            first = len(steps)
            for depth in range(0, plan.max_depth + 1, chunk):
                ms = (2.0 + 0.01 * chunk + 0.1 * batch + depth / 1000.0) * rng.uniform(0.97, 1.03)
                steps.append(_step(len(steps), ms, chunk, depth, batch))
            for _ in range(plan.tail_steps):
                steps.append(_step(len(steps), (2.0 + 0.1 * batch) * rng.uniform(0.97, 1.03), 0, 0, batch))
            phases.append(Phase(chunk, batch, first, len(steps), wall_s=0.5))
    return ProfileRun(model="tiny", steps=steps, phases=phases, source_id="profile-tiny", sent=sent)


_FIT_PLAN = ProfilePlan(chunk_sizes=(64, 128, 256), max_depth=2048, decode_batches=(1, 4))
_DELIVERY = Delivery(url="http://127.0.0.1:8321", source_id="profile-tiny", sent=166, dropped={"full": 2})


def test_the_profile_report_keeps_its_json_keys_and_shows_the_fit_once():
    report = ProfileResult.of(_FIT_PLAN, _noisy_run(_FIT_PLAN, _DELIVERY)).report(2000.0)
    body = as_json(report)
    measured = ["model", "source_id", "plan", "steps", "wall_s", "chunks", "decode"]
    assert list(body) == [*measured, "ledger", "fit", "advice"]
    plan = {"chunk_sizes": [64, 128, 256], "max_depth": 2048, "decode_batches": [1, 4], "repeats": 1}
    assert body["plan"] == plan
    assert body["ledger"] == {
        "url": "http://127.0.0.1:8321",
        "source_id": "profile-tiny",
        "sent": 166,
        "dropped": {"full": 2},
    }
    assert list(body["chunks"][0]) == [
        "chunk_tokens",
        "decode_batch",
        "steps",
        "max_depth",
        "ms_at_depth_0",
        "ms_per_1k_depth",
    ]
    assert list(body["decode"][0]) == ["decode_batch", "steps", "p50_ms", "p99_ms"]
    # the advice is the API's advice less its fit, which the report shows once beside the tables
    advice_fields = [f for f in msgspec.structs.fields(Advice) if f.name != "fit"]
    assert list(body["advice"]) == [f.name for f in advice_fields]
    assert body["fit"]["steps_used"] == body["steps"] == 166


def test_the_profile_report_says_why_there_is_no_fit_or_no_advice():
    no_fit = as_json(ProfileResult.of(_FIT_PLAN, _noisy_run(_FIT_PLAN, None)).report(2000.0))
    assert "ledger" not in no_fit and "fit" in no_fit
    short = ProfileResult.of(_FIT_PLAN, _noisy_run(_FIT_PLAN, None))
    short.steps = short.steps[:40]
    body = as_json(short.report(2000.0))
    assert body["fit_error"]["reason"] == "too_little_data" and "fit" not in body and "advice" not in body
    unreachable = as_json(ProfileResult.of(_FIT_PLAN, _noisy_run(_FIT_PLAN, None)).report(1.0))
    assert unreachable["advice_error"]["reason"] == "target_unreachable" and "advice" not in unreachable


def test_the_profile_table_shows_the_cells_the_fit_the_delivery_and_the_advice():
    report = ProfileResult.of(_FIT_PLAN, _noisy_run(_FIT_PLAN, _DELIVERY)).report(2000.0)
    text = render_profile(report)
    assert text.startswith("profile of tiny: 166 steps in 3.0 s (chunks 64, 128, 256; depth up to 2048;")
    assert sum(1 for line in text.splitlines() if line.startswith("      64  ")) == 2  # both batches
    assert "fit:      duration = " in text
    assert "ledger:   166 events sent to http://127.0.0.1:8321 as source profile-tiny" in text
    settings = report.advice.settings
    assert (
        f"advice for 2000 ms at depth {report.advice.depth}: max_num_batched_tokens "
        f"{settings.max_num_batched_tokens}, long_prefill_token_threshold "
        f"{settings.long_prefill_token_threshold} (predicted ITL p99 " in text
    )


def test_the_driver_reports_what_its_exporter_delivered_once_it_is_shut_down():
    class Exporter:
        config = type("Config", (), {"url": "http://127.0.0.1:8321"})()
        source = type("Source", (), {"id": "profile-tiny"})()

        def __init__(self):
            self.stopped = False

        def shutdown(self, timeout):
            self.stopped = True

        def stats(self):
            assert self.stopped  # counted after the last batch went out
            return type("Stats", (), {"sent": 41, "dropped": {"spool_full": 1}})()

    assert _delivered(Exporter()) == Delivery(
        url="http://127.0.0.1:8321", source_id="profile-tiny", sent=41, dropped={"spool_full": 1}
    )


def test_the_engine_kwargs_win_over_the_drivers_own_and_their_dtype_over_the_machines(monkeypatch):
    built: list[dict] = []

    class LLM:  # stands in for vllm.LLM: takes the keyword arguments
        def __init__(self, **kwargs):
            built.append(kwargs)

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM))
    monkeypatch.setattr(EngineSettings, "apply_threads", lambda self: None)  # leave torch's threads be
    monkeypatch.setenv("CHUNKLEDGER_ENGINE_DEVICE", "cpu")
    plan = ProfilePlan()
    mine = EngineKwargs(dtype="bfloat16", max_num_seqs=3, seed=7)
    _start_engine("/models/tiny", "tiny", plan, 1 << 20, mine)
    _start_engine("/models/tiny", "tiny", plan, 1 << 20, None)
    given, default = built
    assert {k: given[k] for k in mine} == mine
    assert given["scheduler_cls"] == "engine_hooks.vllm.LedgerScheduler"
    assert given["max_model_len"] == plan.max_model_len and given["kv_cache_memory_bytes"] == 1 << 20
    assert set(given) == set(default) | {"dtype"} and set(given) <= set(EngineKwargs.__annotations__)
    assert default["seed"] == plan.seed


def test_theil_sen_line_ignores_a_few_stalled_steps():
    x = np.arange(10, dtype=float)
    y = 8.0 + 6.0 * x
    y[[7, 9]] += 300.0  # two stalls
    slope, base = theil_sen(x, y)
    assert slope == pytest.approx(6.0) and base == pytest.approx(8.0)
    assert np.polyfit(x, y, 1)[0] != pytest.approx(6.0, abs=1.0)  # least squares is pulled away


@pytest.mark.vllm
def test_profile_drives_vllm_through_the_plugin_and_sends_the_steps_to_a_ledger(ledger_server, tmp_path):
    pytest.importorskip("vllm")
    from engine_hooks.vllm.tiny_model import build_tiny_model, vllm_env

    model = build_tiny_model(tmp_path / "tiny", hidden=128, layers=1, max_pos=1024)
    saved = dict(os.environ)
    os.environ.update(vllm_env(tmp_path / "vllm"))
    os.environ["CHUNKLEDGER_VLLM_ADMISSION_RESERVE"] = "0.5"  # a policy the profile must switch off
    try:
        result = runner.invoke(
            cli_app,
            [
                "profile",
                model,
                "--chunk-sizes",
                "32,64,128",
                "--max-depth",
                "256",
                "--decode-batches",
                "1,3",
                "--repeats",
                "2",
                "--kv-cache-mib",
                "64",
                "--ledger",
                ledger_server.url,
                "--source-id",
                "profile-tiny",
                "--itl-target-ms",
                "1000",
                "--format",
                "json",
            ],
        )
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert result.exit_code in (0, 1), result.output
    report = json.loads(result.stdout)
    # Every planned (chunk, decode batch) cell was measured at every depth 0..256 in chunk steps.
    cells = {(c["chunk_tokens"], c["decode_batch"]): c for c in report["chunks"]}
    assert set(cells) == {(t, b) for t in (32, 64, 128) for b in (1, 3)}
    for (chunk, _), c in cells.items():
        assert c["max_depth"] == 256
        assert c["steps"] >= 2 * (256 // chunk)  # two repeats, a chunk at every multiple of T
    assert {d["decode_batch"] for d in report["decode"]} == {1, 3}
    assert all(d["steps"] >= 2 * 8 for d in report["decode"])  # the decode-only tail of each run
    # The fit ran on those steps (or said exactly why not), and the ledger got the same steps.
    if "fit" in report:
        assert report["fit"]["steps_used"] == report["steps"]
        assert report["fit"]["covers"]["prefill_depth"][1] == 256
    else:
        assert report["fit_error"]["reason"]
    assert report["ledger"]["source_id"] == "profile-tiny" and report["ledger"]["dropped"] == {}
    sources = httpx.get(f"{ledger_server.url}/v1/sources").json()["sources"]
    (src,) = [s for s in sources if s["source_id"] == "profile-tiny"]
    assert src["model"] == "tiny" and src["events_total"] == report["ledger"]["sent"]
    advised = runner.invoke(
        cli_app,
        [
            "advise",
            "--itl-target-ms",
            "1000",
            "--source",
            "profile-tiny",
            "--ledger",
            ledger_server.url,
            "--format",
            "json",
        ],
    )
    body = json.loads(advised.stdout)
    assert body["window"]["steps_read"] == report["steps"]
