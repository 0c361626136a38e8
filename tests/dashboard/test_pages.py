"""Every dashboard page, run with Streamlit's AppTest against a real ledger holding a recorded run.

Checks that pages raise nothing, show the numbers the API holds, link to the requests behind a point,
and say "not available" (instead of failing) where a ledger lacks an endpoint or has no data.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import httpx
import msgspec
import pandas as pd
import pyarrow as pa
import pytest
from streamlit.testing.v1 import AppTest

from dashboard import ui
from dashboard.data import LedgerData, NotFound, Unavailable
from dashboard.frames import bucket_for, bucket_start, layers_long, short_setting, tails_long, timeline
from ledger.analytics.answers import METRICS, Attribution, AttributionGroup
from ledger.analytics.why_answer import Why, WhyLayers
from ledger.client import LedgerClient


def texts(at: AppTest) -> str:
    """Every piece of text the page shows."""
    parts: list[Any] = []
    for kind in ("title", "subheader", "markdown", "caption", "info", "warning", "error", "success"):
        parts += [e.value for e in getattr(at, kind)]
    parts += [f"{m.label}: {m.value}" for m in at.metric]
    return "\n".join(str(p) for p in parts)


def no_exceptions(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


def _arrow(raw: bytes) -> list[dict[str, Any]]:
    return pa.ipc.open_stream(raw).read_all().to_pylist() if raw else []


def charts(at: AppTest) -> list[dict[str, Any]]:
    """The Vega-Lite specs the page drew, each with the rows of all its datasets under "rows"."""
    out = []
    for el in at.get("vega_lite_chart"):
        spec = json.loads(el.proto.spec)
        rows: list[Any] = []
        for d in spec.get("datasets", {}).values():
            rows += d
        if el.proto.HasField("data"):
            rows += _arrow(el.proto.data.data)
        for ds in el.proto.datasets:
            rows += _arrow(ds.data.data)
        spec["rows"] = rows
        out.append(spec)
    return out


def metric(at: AppTest, label: str) -> str:
    for m in at.metric:
        if m.label == label:
            return str(m.value)
    raise AssertionError(f"no metric {label!r}: {[m.label for m in at.metric]}")


# -- overview ---------------------------------------------------------------------------------------
def test_overview_shows_the_ledgers_tails_and_counts(recorded_ledger, run_page, api) -> None:
    at = run_page(recorded_ledger.url, "overview")
    no_exceptions(at)
    whole = api.get("/v1/attribution", since="1h")
    g = whole["groups"][0]
    # the recorded scene has a gateway in front: TTFT is the clients'
    assert g["layers"]["client_ttft_s"]["n"] > 0
    assert metric(at, "TTFT p99") == ui.fmt_ms(g["layers"]["client_ttft_s"]["p99"])
    assert metric(at, "end to end p99") == ui.fmt_ms(g["layers"]["e2e_s"]["p99"])
    assert metric(at, "ITL p99") == ui.fmt_ms(whole["itl"][0]["p99"])
    assert metric(at, "finished requests") == f"{g['requests']:,}"
    # TTFT, e2e, ITL, stacked layers, p99 per layer, two throughput charts: every one has data.
    specs = charts(at)
    assert len(specs) >= 7
    assert all(s["rows"] for s in specs)
    shown = texts(at)
    assert "p50" in shown and "p90" in shown  # tails beside every headline p99
    assert "running" in [m.label for m in at.metric]


def _group(layers: dict[str, dict[str, int]]) -> AttributionGroup:
    """An attribution group with these layers' counts, the others' 0, and no tails."""
    nothing = {"n": 0, "p50": None, "p90": None, "p99": None, "max": None, "mean": None}
    group = {
        "requests": 0,
        "output_tokens": 0,
        "preemptions": 0,
        "layers": {m: {**nothing, **layers.get(m, {})} for m in METRICS},
    }
    return msgspec.convert(group, AttributionGroup)


def test_overview_plots_client_ttft_where_a_gateway_measured_it_else_the_engines() -> None:
    from dashboard.views.overview import ttft_metric

    with_gateway = _group({"client_ttft_s": {"n": 3}, "ttft_s": {"n": 3}})
    engine_only = _group({"client_ttft_s": {"n": 0}, "ttft_s": {"n": 3}})
    assert ttft_metric([engine_only, with_gateway]) == "client_ttft_s"
    assert ttft_metric([engine_only]) == "ttft_s"
    assert ttft_metric([]) == "ttft_s"


def test_overview_links_each_p99_point_to_the_requests_behind_it(recorded_ledger, run_page) -> None:
    at = run_page(recorded_ledger.url, "overview")
    links = next(
        df.value for df in at.dataframe if "open" in df.value.columns and "p99 ms" in df.value.columns
    )
    assert len(links) >= 4
    first = links.iloc[0]["open"]
    q = parse_qs(urlparse(first).query)
    assert urlparse(first).path == "requests"
    assert q["sort"] == ["client_ttft_s"] and q["order"] == ["desc"]  # TTFT as the clients saw it
    assert float(q["ended_until"][0]) > float(q["ended_since"][0])


def test_requests_behind_a_bucket_are_the_ones_that_ended_in_it_slowest_first(
    recorded_ledger, run_page, api
) -> None:
    rows = api.get("/v1/requests", sort="end_ts", order="asc", limit=1000, live=False)["rows"]
    lo = rows[len(rows) // 2]["end_ts"] // 10 * 10
    hi = lo + 10
    # ties in ttft_s go by request_id, as the requests view pages them
    expected = sorted(
        (r for r in rows if lo <= r["end_ts"] < hi), key=lambda r: (-r["ttft_s"], r["request_id"])
    )
    assert expected
    at = run_page(
        recorded_ledger.url, "requests", {"ended_since": str(lo), "ended_until": str(hi), "sort": "ttft_s"}
    )
    no_exceptions(at)
    table = at.dataframe[0].value
    assert list(table["request_id"]) == [r["request_id"] for r in expected][: len(table)]
    assert len(table) == len(expected)
    assert table["ttft_s"].iloc[0] == pytest.approx(expected[0]["ttft_s"] * 1e3)  # shown in ms
    assert "finished between" in texts(at)


@pytest.mark.parametrize("column", ["engine_queue_s", "client_ttft_s", "prefill_s", "kv_idle_s", "chunks"])
def test_requests_table_sorts_by_any_layer(recorded_ledger, run_page, column) -> None:
    at = run_page(recorded_ledger.url, "requests", {"sort": column, "order": "asc"})
    no_exceptions(at)
    values = at.dataframe[0].value[column].dropna().tolist()
    assert len(values) > 10
    assert values == sorted(values)


def test_requests_filter_by_finish_reason(recorded_ledger, run_page) -> None:
    at = run_page(recorded_ledger.url, "requests")
    at.selectbox(key="req_finish").select("abort").run()
    no_exceptions(at)
    assert set(at.dataframe[0].value["finish_reason"]) == {"abort"}


# -- one request ------------------------------------------------------------------------------------
def test_request_page_draws_the_timeline_and_the_why_list(recorded_ledger, run_page, api) -> None:
    # A short request that waited behind someone else's long prefill: the scene the ledger is for.
    rows = api.get("/v1/requests", sort="backend_wait_s", order="desc", limit=50, live=False)["rows"]
    r = next(r for r in rows if r["prompt_tokens"] < 2000)
    why = api.get(f"/v1/requests/{r['request_id']}/why")
    at = run_page(recorded_ledger.url, "request", {"id": r["request_id"]})
    no_exceptions(at)
    client = r["client_ttft_s"]
    assert metric(at, "TTFT") == ui.fmt_ms(client if client is not None else r["ttft_s"])
    assert metric(at, "prompt (tokens)") == f"{r['prompt_tokens']:,}"
    (gantt,) = [c for c in charts(at) if "lane" in json.dumps(c)]
    data = pd.DataFrame(gantt["rows"])
    assert {"layers", "steps", "engine"} <= set(data["lane"])
    assert {"engine queue", "prefill", "decode", "chunk", "ran"} <= set(data["what"])
    shown = texts(at)
    for item in why["items"]:
        assert item["kind"].replace("_", " ") in shown
    culprits = [c["request_id"] for i in why["items"] for c in i["culprits"]]
    assert culprits, "a request that waited behind a prefill names it"
    linked = pd.concat([df.value for df in at.dataframe if "open" in df.value.columns])
    assert set(culprits) <= set(linked["request_id"])


def test_request_page_shows_preemption_waits(recorded_ledger, run_page, api) -> None:
    r = api.get("/v1/requests", sort="preemptions", order="desc", limit=1, live=False)["rows"][0]
    assert r["preemptions"] > 0
    at = run_page(recorded_ledger.url, "request", {"id": r["request_id"]})
    no_exceptions(at)
    assert metric(at, "chunks / preemptions") == f"{r['chunks']} / {r['preemptions']}"
    (gantt,) = [c for c in charts(at) if "lane" in json.dumps(c)]
    bars = pd.DataFrame(gantt["rows"])
    assert (bars["what"] == "preempted").sum() == r["resumes"]
    assert "preempted" in texts(at)  # and the why list names the waits


def test_request_page_says_so_for_an_unknown_id(recorded_ledger, run_page) -> None:
    at = run_page(recorded_ledger.url, "request", {"id": "no-such-request"})
    no_exceptions(at)
    assert "no request 'no-such-request'" in texts(at)


# -- KV, cutoffs, advice, SQL -----------------------------------------------------------------------
def test_kv_page_ranks_preemptions_and_idle_kv(recorded_ledger, run_page, api) -> None:
    at = run_page(recorded_ledger.url, "kv")
    no_exceptions(at)
    top = api.get("/v1/requests", since="1h", sort="preemptions", order="desc", limit=1)["rows"][0]
    table = next(df.value for df in at.dataframe if "recomputed_tokens" in df.value.columns)
    assert table["request_id"].iloc[0] == top["request_id"]
    assert table["preemptions"].iloc[0] == top["preemptions"] > 0
    idle = api.get("/v1/requests", since="1h", sort="kv_idle_block_s", order="desc", limit=1)["rows"][0]
    # The simulator schedules every running request each step, so the recording holds no idle KV.
    assert not idle["kv_idle_block_s"]
    assert "no request held KV blocks idle in this window" in texts(at)
    # preemptions over time; KV in use and waiting by model, and of the worst engines
    assert len(charts(at)) >= 5
    ranking = next(df.value for df in at.dataframe if "drawn" in df.value.columns)
    engines = [s for s in api.get("/v1/sources")["sources"] if s["kind"] == "engine"]
    assert sorted(ranking["engine"]) == sorted(s["source_id"] for s in engines)
    assert list(ranking["rank"]) == list(range(1, len(engines) + 1))


def test_cutoffs_page_counts_decisions_by_rule(recorded_ledger, run_page, api) -> None:
    cut = api.get("/v1/cutoffs", limit=1000)["cutoffs"]
    assert cut, "the recorded run has runaways that the rules cut"
    at = run_page(recorded_ledger.url, "cutoffs")
    no_exceptions(at)
    by_rule = pd.DataFrame(cut).groupby(["rule", "action"]).size()
    for (rule, action), n in by_rule.head(4).items():
        assert metric(at, f"{rule} → {action}") == f"{n:,}"
    log = next(df.value for df in at.dataframe if "command_id" in df.value.columns)
    assert set(log["command_id"]) == {c["command_id"] for c in cut}
    # the deliveries' query is one /v1/sql answers (it may not read webhook_subscriptions)
    shown = texts(at)
    assert not at.error, [e.value for e in at.error]
    assert "no webhook deliveries in this window" in shown or any(
        "delivery_id" in df.value.columns for df in at.dataframe
    ), shown


def test_advice_page_shows_the_advised_settings_and_the_fit(recorded_ledger, run_page, api) -> None:
    advice = api.get("/v1/advice/chunk-size", itl_target_ms=50, since="1h")
    at = run_page(recorded_ledger.url, "advice")
    no_exceptions(at)
    assert metric(at, "max_num_batched_tokens") == f"{advice['settings']['max_num_batched_tokens']:,}"
    assert (
        metric(at, "long_prefill_token_threshold")
        == f"{advice['settings']['long_prefill_token_threshold']:,}"
    )
    specs = charts(at)
    assert len(specs) == 2 and all(s["rows"] for s in specs)  # points + fitted curves; residuals
    # A target the user types: a looser target allows a larger chunk.
    at.number_input(key="itl_target").set_value(120.0).run()
    no_exceptions(at)
    looser = api.get("/v1/advice/chunk-size", itl_target_ms=120, since="1h")
    assert metric(at, "max_num_batched_tokens") == f"{looser['settings']['max_num_batched_tokens']:,}"
    assert looser["settings"]["max_num_batched_tokens"] >= advice["settings"]["max_num_batched_tokens"]


def test_advice_page_still_draws_the_fit_when_the_target_cannot_be_met(recorded_ledger, run_page) -> None:
    at = run_page(recorded_ledger.url, "advice")
    at.number_input(key="itl_target").set_value(2.0).run()
    assert not at.exception
    shown = texts(at)
    assert "no advice for 2 ms" in shown
    assert "max_num_batched_tokens" not in [m.label for m in at.metric]
    assert "Fitted step time" in shown
    assert len(charts(at)) == 2


def test_sql_console_runs_a_read_only_query_and_offers_csv(recorded_ledger, run_page, api) -> None:
    at = run_page(recorded_ledger.url, "sql")
    at.text_area(key="sql_text").input(
        "SELECT finish_reason, count(*) AS n FROM requests GROUP BY 1 ORDER BY 1"
    )
    at.button(key="sql_run").click().run()
    no_exceptions(at)
    df = at.dataframe[0].value
    assert list(df.columns) == ["finish_reason", "n"]
    total = api.get("/v1/requests", limit=1)["total"]
    assert df["n"].sum() == total
    assert at.get("download_button"), "a CSV download is offered"


def test_sql_console_shows_the_refusal_of_a_write(recorded_ledger, run_page) -> None:
    at = run_page(recorded_ledger.url, "sql")
    at.text_area(key="sql_text").input("DELETE FROM requests")
    at.button(key="sql_run").click().run()
    assert not at.exception
    assert at.error and "DML" in at.error[0].value


# -- empty and partial ledgers ----------------------------------------------------------------------
@pytest.mark.parametrize("page", ["overview", "requests", "request", "kv", "cutoffs", "advice", "sql"])
def test_every_page_is_fine_on_an_empty_ledger(empty_ledger, run_page, page) -> None:
    at = run_page(empty_ledger.url, page)
    no_exceptions(at)
    shown = texts(at)
    if page == "overview":
        assert "No finished requests in this window yet" in shown
    if page == "advice":
        assert "no advice" in shown


class _OldLedger(BaseHTTPRequestHandler):
    """A ledger that only knows /v1/requests and /v1/sources (as before analytics landed)."""

    def do_GET(self) -> None:
        path = urlparse(self.path).path
        if path == "/v1/requests":
            self._send(200, {"total": 0, "rows": []})
        elif path == "/v1/sources":
            self._send(200, {"sources": []})
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        self._send(404, {"detail": "Not Found"})

    def _send(self, status: int, body: Any) -> None:
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def old_ledger() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OldLedger)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize("page", ["overview", "kv", "cutoffs", "advice", "sql"])
def test_pages_say_not_available_where_the_ledger_lacks_an_endpoint(old_ledger, run_page, page) -> None:
    at = run_page(old_ledger, page)
    if page == "sql":
        at.button(key="sql_run").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert "not available in this ledger" in texts(at)


def test_unreachable_ledger_is_an_error_note_not_a_crash(run_page) -> None:
    at = run_page("http://127.0.0.1:9", "overview")
    assert not at.exception
    assert "cannot reach the ledger" in texts(at)


# -- data layer -------------------------------------------------------------------------------------
def test_data_layer_tells_missing_endpoints_from_missing_things(recorded_ledger) -> None:
    d = LedgerData(recorded_ledger.url)
    with pytest.raises(Unavailable):
        d.get("/v1/no-such-endpoint")
    with pytest.raises(NotFound):
        d.request("no-such-request")


def test_data_layer_caches_reads_for_its_ttl(recorded_ledger, monkeypatch) -> None:
    d = LedgerData(recorded_ledger.url, ttl_s=60)
    calls = []
    real = LedgerClient.get

    def counting(self: LedgerClient, path: str, **params: Any) -> Any:
        calls.append(path)
        return real(self, path, **params)

    monkeypatch.setattr(LedgerClient, "get", counting)
    d.sources()
    d.sources()
    assert calls == ["/v1/sources"]
    LedgerData(recorded_ledger.url, ttl_s=0).sources()
    assert calls == ["/v1/sources", "/v1/sources"]


def test_bucket_width_follows_the_data_span() -> None:
    assert bucket_for(40) == 1
    assert bucket_for(3600) == 120
    assert bucket_for(7 * 86400) == 21600


def test_frames_keep_tails_and_layers_add_up_to_e2e(api) -> None:
    doc = api.get("/v1/attribution", since="1h", bucket_s=10)
    groups = msgspec.convert(doc, Attribution).groups
    tails = tails_long(groups, ["ttft_s"])
    assert set(tails["tail"]) == {"p50", "p90", "p99", "max"}
    layers = layers_long(groups)
    for g in doc["groups"]:
        if g["layers"]["e2e_s"]["mean"] is None:
            continue
        at_t = layers[layers["time"] == pd.to_datetime(g["bucket_ts"], unit="s", utc=True)]
        assert at_t["mean_ms"].sum() == pytest.approx(g["layers"]["e2e_s"]["mean"] * 1e3, rel=1e-6)


def _why(given: dict[str, Any]) -> Why:
    """A why answer with ``given``'s items (each naming no culprit) and nothing else known."""
    items = [{"culprits": [], **item} for item in given["items"]]
    layers = dict.fromkeys(WhyLayers.__struct_fields__)
    why = {"request_id": "r1", "e2e_s": None, "ttft_s": None, "client_ttft_s": None, "layers": layers}
    return msgspec.convert({**why, "items": items}, Why)


def test_timeline_draws_the_steps_a_request_sat_out_from_its_why_list() -> None:
    request = {"start_ts": 100.0, "queued_ts": 100.0, "first_scheduled_ts": 100.5, "end_ts": 103.0}
    why = _why({"items": [{"kind": "sat_out", "seconds": 0.25, "start_ts": 101.0, "detail": "2 steps"}]})
    bars = timeline(request, [], why)
    sat = bars[bars.what == "sat out"].iloc[0]
    assert (sat.lane, sat.start_s, sat.end_s) == ("sat out", 1.0, 1.25)


def test_timeline_bars_start_at_arrival_and_follow_the_layers(api) -> None:
    r = api.get("/v1/requests", sort="preemptions", order="desc", limit=1, live=False)["rows"][0]
    doc = api.get(f"/v1/requests/{r['request_id']}")
    bars = timeline(doc["request"], doc["events"], None)
    layers = bars[bars.lane == "layers"].set_index("what")
    assert layers.loc["entry", "start_s"] == pytest.approx(0.0)
    assert layers.loc["decode", "end_s"] == pytest.approx(r["end_ts"] - r["start_ts"])
    assert (bars.end_s >= bars.start_s).all()


# -- a run recorded from real vLLM (replayed) -------------------------------------------------------
def _preemption_chart(at: AppTest) -> dict[str, Any]:
    (spec,) = [c for c in charts(at) if "preemptions" in json.dumps(c.get("encoding", {}))]
    return spec


def test_kv_preemption_chart_counts_every_preemption_the_ledger_reports(
    vllm_ledger, run_page, vllm_api
) -> None:
    """The recorded vLLM run ended 45 min ago: its requests fall in one or two 120 s buckets of the
    default window. The chart's bars add up to the ledger's preemptions (attribution and the table),
    each bar spans its bucket, and the plot keeps its height (fit-x: titles are added around it)."""
    at = run_page(vllm_ledger.url, "kv")
    no_exceptions(at)
    whole = vllm_api.get("/v1/attribution", since="1h")["groups"][0]
    rows = vllm_api.get("/v1/requests", since="1h", live=False, sort="preemptions", order="desc", limit=1000)
    preempted = [r for r in rows["rows"] if r["preemptions"]]
    assert whole["preemptions"] == sum(r["preemptions"] for r in preempted) >= 10
    spec = _preemption_chart(at)
    bars = pd.DataFrame(spec["rows"])
    assert bars["preemptions"].sum() == whole["preemptions"]
    assert 1 <= len(bars) <= 3  # a short run, 120 s buckets
    bucket_s = 120.0
    assert f"per {int(bucket_s)} s" in json.dumps(spec["title"])
    span = pd.to_datetime(bars["time_end"]) - pd.to_datetime(bars["time"])
    assert (span.dt.total_seconds() == bucket_s).all()
    assert (bars["_top"] - bars["_bottom"] == bars["preemptions"]).all()  # bars from 0 up to the count
    assert spec["autosize"]["type"] == "fit-x" and spec["height"] >= 150
    # the x axis covers the window's data span, not just the run's bucket
    domain = spec["encoding"]["x"]["scale"]["domain"]
    assert pd.Timestamp(domain[1]) - pd.Timestamp(domain[0]) >= pd.Timedelta(minutes=40)
    table = next(df.value for df in at.dataframe if "recomputed_tokens" in df.value.columns)
    assert table["preemptions"].sum() == whole["preemptions"]
    assert list(table["request_id"]) == [r["request_id"] for r in preempted]
    assert f"{whole['preemptions']:,} preemptions" in texts(at)


def _axis_titles(spec: dict[str, Any]) -> list[str]:
    out = []
    for layer in [spec, *spec.get("layer", [])]:
        for ch in ("x", "y"):
            title = (layer.get("encoding", {}).get(ch) or {}).get("title")
            if isinstance(title, str):
                out.append(title)
    return out


@pytest.mark.parametrize("page", ["overview", "kv", "cutoffs", "advice", "request"])
def test_axis_titles_are_short_and_say_their_unit_once(vllm_ledger, run_page, vllm_api, page) -> None:
    query = {}
    if page == "request":
        top = vllm_api.get("/v1/requests", sort="preemptions", order="desc", limit=1, live=False)["rows"][0]
        query = {"id": top["request_id"]}
    at = run_page(vllm_ledger.url, page, query, window="all" if page == "cutoffs" else None)
    no_exceptions(at)
    specs = charts(at)
    assert specs
    for spec in specs:
        assert spec.get("autosize", {}).get("type") == "fit-x", spec.get("title")
        for title in _axis_titles(spec):
            assert len(title) <= 22, title  # fits along a 150 px axis (the browser test measures it)
            assert not ("seconds" in title and "(s)" in title), title
            assert title.count("(") <= 1, title


def test_request_page_tells_an_escape_valve_from_a_cut(vllm_ledger, run_page, vllm_api) -> None:
    """preemption_limit moved the most preempted request to the slow pool: a note, not a "cut off"
    error; the loop rule's aborts are cuts."""
    cut = vllm_api.get("/v1/cutoffs", limit=1000)["cutoffs"]
    valve = next(c for c in cut if c["action"] == "slow_pool" and c["state"] == "applied")
    at = run_page(vllm_ledger.url, "request", {"id": valve["request_id"]})
    no_exceptions(at)
    assert "escape valve" in texts(at) and "cut off by rule" not in texts(at)
    loop = next(c for c in cut if c["rule"] == "loop" and c["state"] == "applied")
    at = run_page(vllm_ledger.url, "request", {"id": loop["request_id"]})
    assert not at.exception
    assert at.error and "cut off by rule **loop**" in at.error[0].value


# -- what-if ------------------------------------------------------------------------------------------
# the simulated engines' KV cache (the kv-pressure one's is smaller: force, the page is what is tested)
SIM_RECORDED = "num_kv_blocks=16384,max_num_seqs=256,reserve_full_isl=false"


def test_whatif_page_replays_only_when_asked(recorded_ledger, run_page) -> None:
    at = run_page(recorded_ledger.url, "whatif")
    no_exceptions(at)
    assert not charts(at) and "Send the form to run it" in texts(at)


def test_whatif_page_shows_measured_replayed_and_asked_settings(recorded_ledger, run_page, api) -> None:
    at = run_page(recorded_ledger.url, "whatif")
    at.text_input(key="wi_sweep").set_value("max_num_batched_tokens=512,4096")
    at.text_input(key="wi_recorded").set_value(SIM_RECORDED)
    at.number_input(key="wi_itl").set_value(40.0)
    at.checkbox(key="wi_force").check()
    at.button[0].click().run()
    no_exceptions(at)
    want = api.get(
        "/v1/whatif",
        sweep="max_num_batched_tokens=512,4096",
        recorded=SIM_RECORDED,
        itl_target_ms=40,
        since="1h",
        force="true",
    )
    table = at.dataframe[0].value
    assert list(table["setting"]) == [
        "measured",
        "recorded (replayed)",
        "max_num_batched_tokens=512",
        "max_num_batched_tokens=4096",
    ]
    got = table.set_index("setting")["short_ttft_p99_ms"]
    for c in want["candidates"]:
        assert got[c["name"]] == pytest.approx(c["predicted"]["short_ttft_p99_s"] * 1e3, abs=0.05)
    best = [c["name"] for c in want["candidates"] if c["best"]]
    assert metric(at, "best setting") == (short_setting(best[0]) if best else "-")
    specs = charts(at)
    assert len(specs) == 2 and all(len(s["rows"]) == 4 for s in specs)  # measured, replayed, the two asked


def test_whatif_page_says_why_the_ledger_declined(recorded_ledger, run_page) -> None:
    at = run_page(recorded_ledger.url, "whatif", {"sweep": "max_num_batched_tokens=512", "run": "1"})
    no_exceptions(at)
    # the kv-pressure engine preempted: without its KV cache size there is no replay
    assert "declined" in texts(at) and "num_kv_blocks" in texts(at) and not charts(at)


def test_setting_names_are_shortened_for_the_charts() -> None:
    assert short_setting("max_num_batched_tokens=512,policy=kv-idle") == "budget 512, policy kv-idle"
    assert short_setting("long_prefill_token_threshold=256") == "threshold 256"
    assert short_setting("something_new=1") == "something_new 1"


def test_data_layer_decodes_each_answer_into_the_record_the_ledger_built(recorded_ledger, api) -> None:
    d = LedgerData(recorded_ledger.url)
    whole = d.attribution("1h")
    assert isinstance(whole, Attribution) and whole.groups[0].requests > 0
    assert whole.groups[0].requests == api.get("/v1/attribution", since="1h")["groups"][0]["requests"]
    bucketed = d.attribution("1h", bucket_s=10).groups
    assert all(isinstance(g, AttributionGroup) and bucket_start(g) % 10 == 0 for g in bucketed)
    rid = api.get("/v1/requests", sort="preemptions", order="desc", limit=1, live=False)["rows"][0]
    why = d.why(rid["request_id"])
    assert isinstance(why, Why) and why.request_id == rid["request_id"]


def test_an_answer_in_another_shape_is_not_available_in_this_ledger(old_ledger) -> None:
    """A ledger whose answer is not the record the dashboard reads there (here: the old ledger's
    sources where an attribution is read) does not serve it."""
    with pytest.raises(Unavailable, match="other than the Attribution record"):
        LedgerData(old_ledger).read(Attribution, "/v1/sources")


def test_an_unbucketed_attribution_group_has_no_bucket_start() -> None:
    with pytest.raises(ValueError, match="bucket_s"):
        bucket_start(_group({}))


def test_request_page_links_the_trace_when_a_trace_ui_is_configured(tmp_path, run_page) -> None:
    from engine_hooks import events as ev
    from tests.support.factories import ENGINE, GATEWAY, body, lifecycle, numbered
    from tests.support.servers import LedgerServer

    trace, caller = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    env = {"CHUNKLEDGER_TRACE_URL": "http://jaeger.example:16686/trace/{trace_id}"}
    server = LedgerServer(f"duckdb:///{tmp_path / 'ledger.duckdb'}", tmp_path / "ledger.log", env)
    server.start()
    try:
        gw, en = lifecycle("traced")
        gw[0] = msgspec.structs.replace(
            gw[0], trace_id=trace, parent_span_id=caller, span_id="b7ad6b7169203331"
        )
        plain = [ev.Queued(seq=0, ts=5.0, request_id="plain", prompt_tokens=3)]
        for source, events in ((GATEWAY, gw), (ENGINE, numbered(en) + numbered(plain, start=100))):
            httpx.post(
                server.url + "/v1/events",
                content=body(source, numbered(events) if source is GATEWAY else events),
                headers={"content-type": "application/json"},
            ).raise_for_status()
        at = run_page(server.url, "request", {"id": "traced"})
        no_exceptions(at)
        assert f"[`{trace}`](http://jaeger.example:16686/trace/{trace})" in texts(at)
        assert f"parent span `{caller}`" in texts(at)
        untraced = run_page(server.url, "request", {"id": "plain"})
        no_exceptions(untraced)
        assert "trace" not in texts(untraced)
    finally:
        server.stop()
