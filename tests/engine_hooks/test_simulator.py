"""The fleet simulator: determinism, the event mix it produces, commands, and its one-line JSON summary."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import msgspec
import pytest
import typer
from typer.testing import CliRunner

from chunkledger.simulator import simulate
from engine_hooks.events import Chunk, Command, Finished, Preempted, Queued, Step, Tokens
from engine_hooks.simulation.fleet import ExporterTotals
from engine_hooks.simulator import SCENARIOS, Drain, Fleet, SimulationSummary, run_simulation
from tests.support.factories import output_token_ids
from tests.support.fake_ledger import FakeLedger, wait_until

FAST = {"spool_fsync": False, "flush_interval_s": 0.01}


def _simulate(ledger: FakeLedger, tmp_path, **kw):
    """run_simulation against the fake ledger, unpaced, with fast flushing."""
    return run_simulation(ledger_url=ledger.url, spool_dir=str(tmp_path), pace=False, overrides=FAST, **kw)


def _events_by_source(ledger: FakeLedger, prefix: str) -> dict[str, list[tuple[str, object]]]:
    out: dict[str, list[tuple[str, object]]] = {}
    for (sid, _, kind), event in zip(ledger.rows, ledger.store.events, strict=True):
        if sid.startswith(prefix):
            absolute = {"seq", "ts", "first_ts", "arrival_ts"}  # the rest is decided by the seed alone
            fields = {k: v for k, v in msgspec.structs.asdict(event).items() if k not in absolute}
            if "request_id" in fields:
                fields["request_id"] = fields["request_id"].removeprefix(prefix)
            if "request_ids" in fields:
                fields["request_ids"] = [r.removeprefix(prefix) for r in fields["request_ids"]]
            out.setdefault(sid.removeprefix(prefix), []).append((kind, sorted(fields.items())))
    return out


def test_same_seed_emits_the_same_events(fake_ledger, tmp_path):
    runs = []
    for prefix in ("a", "b"):
        _simulate(
            fake_ledger,
            tmp_path,
            engines=2,
            rps=30,
            duration_s=1.0,
            seed=7,
            source_prefix=prefix,
        )
        runs.append(_events_by_source(fake_ledger, prefix))
    assert runs[0] == runs[1]
    assert sum(len(v) for v in runs[0].values()) > 100


def test_different_seeds_emit_different_events(fake_ledger, tmp_path):
    runs = []
    for prefix, seed in (("a", 1), ("b", 2)):
        _simulate(
            fake_ledger,
            tmp_path,
            engines=1,
            rps=30,
            duration_s=1.0,
            seed=seed,
            source_prefix=prefix,
        )
        runs.append(_events_by_source(fake_ledger, prefix))
    assert runs[0] != runs[1]


def test_summary_counts_match_what_the_ledger_stored(fake_ledger, tmp_path):
    summary = _simulate(
        fake_ledger,
        tmp_path,
        engines=3,
        rps=50,
        duration_s=1.0,
        seed=3,
    )
    stored = Counter(sid for sid, _, _ in fake_ledger.rows)
    assert set(summary["emitted"]) == {"sim-engine-0", "sim-engine-1", "sim-engine-2", "sim-gateway-0"}
    assert summary["emitted"] == dict(stored)
    last = {sid: max(seq for s, seq, _ in fake_ledger.rows if s == sid) for sid in stored}
    assert summary["last_seq"] == last
    assert summary["exporter"]["sent"] == sum(stored.values())
    assert summary["exporter"]["dropped"] == {}


def test_the_summary_has_the_fields_its_type_names_and_no_other(fake_ledger, tmp_path):
    summary = _simulate(fake_ledger, tmp_path, engines=1, rps=20, duration_s=0.3, seed=1)
    assert set(summary) == SimulationSummary.__required_keys__
    assert set(summary["exporter"]) == ExporterTotals.__required_keys__
    assert set(summary["drain"]) == Drain.__required_keys__


def test_overrides_of_what_the_fleet_sets_itself_are_refused(tmp_path):
    with pytest.raises(ValueError, match="the simulator sets source_id, url itself"):
        run_simulation(
            engines=1,
            rps=1,
            duration_s=0.1,
            ledger_url="http://127.0.0.1:9",
            spool_dir=str(tmp_path),
            overrides={"url": "http://127.0.0.1:8", "source_id": "one", "batch_size": 10},
        )


def test_long_prompts_are_chunked_under_the_token_budget(fake_ledger, tmp_path):
    _simulate(
        fake_ledger,
        tmp_path,
        engines=1,
        rps=20,
        duration_s=3.0,
        scenario="long-prompts",
        seed=5,
    )
    events = fake_ledger.store.events
    budget = SCENARIOS["long-prompts"].max_num_batched_tokens
    chunks = [e for e in events if isinstance(e, Chunk)]
    assert max(c.computed_before for c in chunks) >= budget  # some prompt needed several chunks
    assert all(c.tokens <= budget for c in chunks)
    for s in (e for e in events if isinstance(e, Step)):
        assert s.prefill_tokens + s.decode_tokens <= budget
        assert len(s.request_ids) == s.num_prefill_reqs + s.num_decode_reqs
    assert any(isinstance(e, Queued) and e.prompt_tokens == 20_000 for e in events)


def test_kv_pressure_causes_preemptions_and_recompute_chunks(fake_ledger, tmp_path):
    _simulate(
        fake_ledger,
        tmp_path,
        engines=1,
        rps=40,
        duration_s=6.0,
        scenario="kv-pressure",
        seed=2,
    )
    kinds = Counter(kind for _, _, kind in fake_ledger.rows)
    assert kinds["preempted"] > 0 and kinds["resumed"] > 0
    recompute = [e for e in fake_ledger.store.events if isinstance(e, Chunk) and e.preemptions > 0]
    assert recompute and sum(c.recomputed_tokens for c in recompute) > 0
    assert all(
        c.recomputed_tokens == 0
        for c in fake_ledger.store.events
        if isinstance(c, Chunk) and not c.preemptions
    )
    assert all(e.kv_blocks_freed > 0 for e in fake_ledger.store.events if isinstance(e, Preempted))


def test_runaways_loop_without_a_token_cap(fake_ledger, tmp_path):
    _simulate(
        fake_ledger,
        tmp_path,
        engines=1,
        rps=20,
        duration_s=2.0,
        scenario="runaway",
        seed=4,
    )
    uncapped = {
        e.request_id for e in fake_ledger.store.events if isinstance(e, Queued) and e.max_tokens is None
    }
    assert uncapped
    by_request = output_token_ids(fake_ledger.store.events)
    ids = [t for rid in uncapped for t in by_request.get(rid, [])]
    assert len(ids) > 30 and set(ids) == {101, 2023, 318}


def test_abort_command_cuts_the_request_off_and_both_sources_confirm(tmp_path):
    ledger = FakeLedger()
    try:
        received: list[Command] = []

        def make_exporter(sid, kind, on_command):
            from engine_hooks.config import ExporterConfig
            from engine_hooks.exporter import Exporter

            def hook(command: Command) -> None:
                received.append(command)
                if on_command is not None:
                    on_command(command)

            config = ExporterConfig.create(
                url=ledger.url, source_id=sid, source_kind=kind, spool_dir=str(tmp_path), **FAST
            )
            return Exporter(config, on_command=hook if kind == "engine" else None)

        scenario = replace(SCENARIOS["steady"], output_median=2000, max_tokens=4000, disconnect_p=0.0)
        fleet = Fleet(engines=1, rps=5, scenario=scenario, seed=1, make_exporter=make_exporter)
        ledger.commands = [Command(id="cmd-1", request_id="sim-1-req-0000001", action="abort", rule="loop")]
        fleet.run(3.0, pace=True)
        assert received, "the engine never got the command"
        for exporter in fleet.exporters.values():
            exporter.shutdown(5)
        assert wait_until(lambda: any(kind == "stream_cut" for _, _, kind in ledger.rows), 2)
        events = ledger.store.events
        finished = [e for e in events if isinstance(e, Finished) and e.request_id == "sim-1-req-0000001"]
        assert [(f.reason, f.stop_reason) for f in finished] == [("cutoff", "chunkledger:loop")]
        kinds = {kind for _, _, kind in ledger.rows}
        assert {"cutoff_applied", "stream_cut"} <= kinds
    finally:
        ledger.stop()


def test_cli_prints_one_json_line_with_emitted_last_seq_and_counters(fake_ledger, tmp_path):
    app = typer.Typer()
    app.command()(simulate)
    result = CliRunner().invoke(
        app,
        [
            "--engines",
            "2",
            "--rps",
            "20",
            "--duration",
            "0.5",
            "--ledger",
            fake_ledger.url,
            "--seed",
            "9",
            "--spool-dir",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1
    summary = json.loads(lines[0])
    assert (
        set(summary["emitted"])
        == set(summary["last_seq"])
        == {"sim-engine-0", "sim-engine-1", "sim-gateway-0"}
    )
    assert {"sent", "retried", "spooled", "dropped"} <= set(summary["exporter"])
    assert summary["exporter"]["sent"] == sum(summary["emitted"].values())


def test_cli_refuses_an_unknown_scenario_and_a_missing_ledger(tmp_path, monkeypatch):
    monkeypatch.delenv("CHUNKLEDGER_URL", raising=False)
    app = typer.Typer()
    app.command()(simulate)
    result = CliRunner().invoke(app, ["--duration", "0.1"])
    assert result.exit_code == 2 and "--ledger" in result.output
    result = CliRunner().invoke(
        app, ["--ledger", "http://127.0.0.1:9", "--scenario", "nope", "--spool-dir", str(tmp_path)]
    )
    assert result.exit_code == 2 and "unknown scenario" in result.output


def test_simulated_streams_keep_the_ledgers_token_accounting(fake_ledger, tmp_path):
    """Folded by the ledger, every request past its prefill has cached + first-time prefill = prompt,
    even after preemptions (which the recompute chunks must count as recomputed, not new)."""
    from engine_hooks.events import Source
    from ledger.fold import fold

    _simulate(
        fake_ledger,
        tmp_path,
        engines=1,
        rps=40,
        duration_s=6.0,
        scenario="kv-pressure",
        seed=2,
    )
    pairs = [
        (Source(id=sid, kind="engine"), e)
        for (sid, _, kind), e in zip(fake_ledger.rows, fake_ledger.store.events, strict=True)
        if "engine" in sid
    ]
    rows = fold(pairs)
    prefilled = [r for r in rows.values() if r.get("first_token_ts") is not None and r.get("prompt_tokens")]
    assert sum(r.get("recomputed_tokens", 0) for r in prefilled) > 0  # preemptions happened and resumed
    bad = [
        r
        for r in prefilled
        if r.get("cached_tokens", 0) + r.get("prefill_computed_tokens", 0) != r["prompt_tokens"]
    ]
    assert bad == []


def test_a_run_waits_for_its_backlog_says_what_stays_spooled_and_the_next_run_sends_it(
    fake_ledger, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # the default spool folder is .chunkledger/spool under the working dir
    monkeypatch.delenv("CHUNKLEDGER_SPOOL_DIR", raising=False)
    fake_ledger.stop()
    kw = {"engines": 1, "rps": 20, "ledger_url": fake_ledger.url, "pace": False, "overrides": FAST}
    first = run_simulation(duration_s=0.5, seed=1, drain_timeout_s=0.5, shutdown_timeout_s=1, **kw)
    drain = first["drain"]
    assert not drain["drained"] and drain["spool_dir"] == str(tmp_path / ".chunkledger" / "spool" / "sim")
    assert drain["spool_pending"] == first["emitted"]  # the ledger was down: everything stays spooled
    fake_ledger.start()
    second = run_simulation(duration_s=0.2, seed=2, **kw)
    assert second["drain"]["drained"] and second["drain"]["spool_pending"] == {}
    stored = Counter(sid for sid, _, _ in fake_ledger.rows)
    assert stored == Counter(first["emitted"]) + Counter(second["emitted"])


def test_cli_warns_when_the_ledger_did_not_take_everything_in_time(fake_ledger, tmp_path):
    fake_ledger.stop()
    app = typer.Typer()
    app.command()(simulate)
    args = ["--engines", "1", "--duration", "0.3", "--ledger", fake_ledger.url, "--spool-dir", str(tmp_path)]
    result = CliRunner().invoke(app, [*args, "--drain-timeout", "0.3"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.splitlines()[0])
    assert summary["drain"]["drained"] is False
    waiting = sum(summary["drain"]["spool_pending"].values())
    assert waiting > 0 and f"{waiting} events stay spooled in {tmp_path / 'sim'}" in result.stderr


def test_output_tokens_ride_on_step_events_one_entry_per_request_that_ran(fake_ledger, tmp_path, monkeypatch):
    monkeypatch.setitem(SCENARIOS, "steady-steps", replace(SCENARIOS["steady"], step_tokens=True))
    _simulate(fake_ledger, tmp_path, engines=1, rps=40, duration_s=1.0, seed=3, scenario="steady-steps")
    events = fake_ledger.store.events
    assert not [e for e in events if isinstance(e, Tokens)]
    steps = [e for e in events if isinstance(e, Step)]
    assert steps and all(len(s.token_counts) == len(s.request_ids) == len(s.token_totals) for s in steps)
    assert all(len(s.token_ids) == sum(s.token_counts) for s in steps)
    counted: Counter[str] = Counter()
    for s in steps:
        for rid, count, total, _ids in s.token_groups():
            counted[rid] += count
            assert total == counted[rid]  # the running total after this step
    finished = {e.request_id: e.output_tokens for e in events if isinstance(e, Finished)}
    assert finished and all(counted[rid] == n for rid, n in finished.items())


def test_with_step_tokens_off_the_same_tokens_come_as_tokens_events(fake_ledger, tmp_path, monkeypatch):
    monkeypatch.setitem(SCENARIOS, "steady", replace(SCENARIOS["steady"], step_tokens=True))
    monkeypatch.setitem(SCENARIOS, "steady-events", replace(SCENARIOS["steady"], step_tokens=False))
    ids: dict[str, dict[str, list[int]]] = {}
    done: dict[str, set[str]] = {}
    for prefix, scenario in (("a", "steady"), ("b", "steady-events")):
        _simulate(
            fake_ledger,
            tmp_path,
            engines=1,
            rps=40,
            duration_s=3.0,
            seed=5,
            scenario=scenario,
            source_prefix=prefix,
        )
        mine = [
            e
            for sid, e in zip((r[0] for r in fake_ledger.rows), fake_ledger.store.events, strict=True)
            if sid.startswith(prefix)
        ]
        kinds = Counter(type(e).__name__ for e in mine)
        assert (kinds["Tokens"] > 0) == (scenario == "steady-events")
        ids[prefix] = {rid.removeprefix(prefix): t for rid, t in output_token_ids(mine).items()}
        done[prefix] = {e.request_id.removeprefix(prefix) for e in mine if isinstance(e, Finished)}
    # A request still decoding at the end has sent every token on its steps, but a tokens event only
    # every tokens_flush tokens: what the events sent is the start of what the steps sent.
    assert done["a"] == done["b"] and len(done["a"]) >= 20
    assert ids["b"].keys() <= ids["a"].keys() and sum(len(t) for t in ids["a"].values()) > 100
    for rid, steps in ids["a"].items():
        events = ids["b"].get(rid, [])
        assert events == steps if rid in done["a"] else steps[: len(events)] == events


class _Recorder:
    """An exporter stand-in that keeps what is emitted: (source, event kind, values)."""

    def __init__(self, sid: str, out: list) -> None:
        self.sid, self.out = sid, out

    def emitter(self, kind, *fields):
        def emit(*values):
            self.out.append((self.sid, kind.__name__, values))

        emit.many = lambda rows: [emit(*row) for row in rows]
        return emit


def test_an_abort_for_a_request_another_engine_runs_is_left_to_that_engine():
    out: list = []
    fleet = Fleet(
        engines=2,
        rps=20,
        scenario=replace(SCENARIOS["steady"], output_median=2000, max_tokens=4000, disconnect_p=0.0),
        seed=1,
        make_exporter=lambda sid, kind, on_command: _Recorder(sid, out),
    )
    fleet.run(0.5, pace=False)
    one, other = fleet.engines
    victim = next(iter(other.by_id.values()))
    one.commands.put(Command(id="c1", request_id=victim.id, action="abort", rule="loop"))
    one.apply_commands(0.5)
    assert not victim.finished and victim.id in other.by_id
    assert not [e for e in out if e[1] == "CutoffApplied"]
    other.commands.put(Command(id="c2", request_id=victim.id, action="abort", rule="loop"))
    other.apply_commands(0.5)
    assert victim.finished and victim.id not in other.by_id
    assert [e[2][1] for e in out if e[1] == "CutoffApplied"] == [victim.id]
