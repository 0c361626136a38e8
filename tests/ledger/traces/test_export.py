"""OTLP export of finished requests, end to end in one process: a real ledger app, events posted as
sources post them, the SDK's OTLP/HTTP exporter, and a real receiver decoding with opentelemetry-proto."""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from fastapi.testclient import TestClient

from engine_hooks import events as ev
from ledger.app import create_app
from ledger.config import Settings
from ledger.traces.enabled import export_enabled
from tests.support.factories import ENGINE, GATEWAY, body, lifecycle, numbered
from tests.support.fake_ledger import wait_until
from tests.support.otlp_receiver import OtlpReceiver

TOKENS = {"ingest_token": "ing", "read_token": "rd", "admin_token": "adm"}
ING = {"Authorization": "Bearer ing", "content-type": "application/json"}
RD = {"Authorization": "Bearer rd"}
TRACE, CALLER, GATEWAY_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", "b7ad6b7169203331"
LAYERS = ["entry", "admission", "frontend", "engine_queue", "prefill", "decode"]


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver()
    yield r
    r.stop()


def _app(db_url: str, endpoint: str, **settings: Any) -> TestClient:
    return TestClient(
        create_app(
            Settings(db_url=db_url, otlp_traces_endpoint=endpoint, traces_delay_s=0.2, **TOKENS, **settings)
        )
    )


def _post(client: TestClient, source: ev.Source, events: list) -> None:
    r = client.post("/v1/events", content=body(source, events), headers=ING)
    assert r.status_code == 200, r.text


def _traced(rid: str, t0: float) -> tuple[list, list]:
    gw, en = lifecycle(rid, t0)
    return [
        msgspec.structs.replace(gw[0], trace_id=TRACE, parent_span_id=CALLER, span_id=GATEWAY_SPAN),
        *gw[1:],
    ], en


def test_a_finished_request_is_one_trace_under_the_callers_span_with_layers_that_add_up(db_url, receiver):
    t0 = time.time() - 5
    gw, en = _traced("t1", t0)
    with _app(db_url, receiver.url) as client:
        _post(client, GATEWAY, numbered(gw))
        _post(client, ENGINE, numbered(en))
        assert wait_until(lambda: len(receiver.of_trace(TRACE)) >= 8, timeout=10)
        row = client.get("/v1/requests/t1", headers=RD).json()["request"]
        metrics = client.get("/metrics", headers=RD).text
    spans = {s.name: s for s in receiver.of_trace(TRACE)}
    request = spans.pop(f"text_completion {ENGINE.model}")  # GenAI: "{operation} {model}"
    assert (request.span_id, request.parent_span_id, request.kind) == (GATEWAY_SPAN, CALLER, 2)  # SERVER
    attrs = request.attributes
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.usage.input_tokens"] == 300 and attrs["gen_ai.usage.output_tokens"] == 10
    assert attrs["gen_ai.request.max_tokens"] == 64
    assert attrs["gen_ai.response.finish_reasons"] == ["stop"]
    assert attrs["gen_ai.latency.time_to_first_token"] == pytest.approx(row["ttft_s"])
    assert attrs["chunkledger.request_id"] == "t1"
    assert request.resource["service.name"] == "chunkledger" and request.scope == "chunkledger"
    assert request.duration_ns == pytest.approx(row["e2e_s"] * 1e9, abs=2)
    # The layers tile the request span: each starts where the one before ended, and they add up.
    layers = [spans[name] for name in LAYERS]
    assert all(s.parent_span_id == GATEWAY_SPAN for s in layers)
    assert layers[0].start_ns == request.start_ns and layers[-1].end_ns == pytest.approx(
        request.end_ns, abs=2
    )
    for before, after in itertools.pairwise(layers):
        assert after.start_ns == before.end_ns
    assert sum(s.duration_ns for s in layers) == pytest.approx(request.duration_ns, abs=len(layers))
    for name in ("entry", "admission", "frontend", "prefill", "decode"):
        assert spans[name].attributes["chunkledger.layer_s"] == pytest.approx(row[f"{name}_s"])
    # The preemption's idle time: a child of the prefill span it delayed, inside it, 0.1 s long.
    idle = spans["preempted"]
    prefill = spans["prefill"]
    assert idle.parent_span_id == prefill.span_id
    assert prefill.start_ns <= idle.start_ns < idle.end_ns <= prefill.end_ns
    assert idle.duration_ns == pytest.approx(0.1e9, abs=1e3)
    # (unix seconds as doubles: a stamp is good to about 0.25 us)
    assert prefill.duration_ns - idle.duration_ns == pytest.approx(row["prefill_s"] * 1e9, abs=1e3)
    # Each prefill chunk is an event of the prefill span, with its tokens, depth and cache hits.
    chunks = [e for e in prefill.events if e[0] == "prefill_chunk"]
    assert [
        (a["chunkledger.tokens"], a["chunkledger.depth_tokens"], a["chunkledger.cached_tokens"])
        for _, _, a in chunks
    ] == [
        (128, 44, 44),
        (128, 172, 0),
        (128, 0, 0),
    ]
    assert "chunkledger_trace_spans_exported_total 8.0" in metrics
    assert receiver.content_types == {"application/x-protobuf"}


def test_a_cut_request_carries_the_cutoff_as_an_event_and_untraced_ones_get_a_trace_of_their_own(
    db_url, receiver
):
    t0 = time.time() - 5
    gw, en = lifecycle("cut", t0, preempt=False)
    gw = [*gw[:-1], ev.StreamCut(seq=0, ts=t0 + 1.5, request_id="cut", rule="loop", command_id="c1"), gw[-1]]
    en = [
        *en[:-1],
        ev.Finished(
            seq=0,
            ts=t0 + 1.5,
            request_id="cut",
            reason="cutoff",
            output_tokens=10,
            stop_reason="chunkledger:loop",
        ),
    ]
    with _app(db_url, receiver.url) as client:
        _post(client, GATEWAY, numbered(gw))
        _post(client, ENGINE, numbered(en))
        assert wait_until(
            lambda: any(s.attributes.get("chunkledger.request_id") == "cut" for s in receiver.spans),
            timeout=10,
        )
    (request,) = [s for s in receiver.spans if s.attributes.get("chunkledger.request_id") == "cut"]
    assert request.parent_span_id == ""  # no caller: the request span is the root
    assert request.attributes["gen_ai.response.finish_reasons"] == ["cutoff"]
    assert [(name, a["chunkledger.rule"]) for name, _, a in request.events] == [("cutoff", "loop")]
    assert request.events[0][1] == pytest.approx((t0 + 1.5) * 1e9, abs=1e3)
    assert wait_until(lambda: len(receiver.of_trace(request.trace_id)) == 7, timeout=5)  # request + 6 layers


def test_a_dead_endpoint_keeps_memory_bounded_counts_the_drops_and_leaves_ingest_alone(db_url, monkeypatch):
    """The same 60 requests into a ledger without export and into one exporting to a port nothing
    listens on: every batch accepted, the same rows, the span queue never past its bound, every span
    lost and counted, ingest no slower than a loose bound."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "0.5")  # seconds: the SDK's retries give up
    dead = OtlpReceiver()
    dead_url = dead.url
    dead.stop()  # its port refuses connections now
    t0 = time.time() - 5
    runs: dict[str, dict[str, Any]] = {}
    for name, endpoint in (("off", ""), ("dead", dead_url)):
        gateway = ev.Source(id=f"gw-{name}", kind="gateway")
        engine = ev.Source(id=f"engine-{name}", kind="engine", model="tiny-llama")
        with _app(db_url, endpoint, traces_max_queue_spans=40, traces_batch_spans=16) as client:
            export = client.app.state.traces
            assert (export is None) == (name == "off")
            started = time.perf_counter()
            for i in range(0, 60, 10):
                gws, ens = [], []
                for k in range(i, i + 10):
                    gw, en = lifecycle(f"{name}-r{k}", t0)
                    gws += gw
                    ens += en
                _post(client, gateway, numbered(gws, start=1 + i * 100))
                _post(client, engine, numbered(ens, start=1 + i * 100))
            ingest_s = time.perf_counter() - started
            if export is not None:
                peak = [0]
                lost = functools.partial(_lost, client, export, peak)
                all_lost = functools.partial(lambda f: f() >= 60 * 8, lost)  # 8 spans a request
                assert wait_until(all_lost, timeout=60), lost()
                assert lost() == 60 * 8 and peak[0] <= 40
                assert _counter(client, "chunkledger_trace_spans_exported_total") == 0
                failures = _counter(client, "chunkledger_trace_export_failures_total")
                assert 1 <= failures <= _counter(client, "chunkledger_trace_exports_total")
            rows = []
            for k in range(60):
                row = client.get(f"/v1/requests/{name}-r{k}", headers=RD).json()["request"]
                rows.append(
                    {c: row[c] for c in ("e2e_s", "ttft_s", "prefill_s", "output_tokens", "finish_reason")}
                )
            runs[name] = {"ingest_s": ingest_s, "rows": rows}
    assert runs["off"]["rows"] == runs["dead"]["rows"]
    assert runs["dead"]["ingest_s"] < 3 * runs["off"]["ingest_s"] + 1.0, runs


def _lost(client: TestClient, export: Any, peak: list[int]) -> float:
    """Spans dropped so far; ``peak``: the most spans seen waiting in the export's queue."""
    peak[0] = max(peak[0], export.queued[1])
    return sum(
        _counter(client, f'chunkledger_trace_spans_dropped_total{{reason="{r}"}}')
        for r in ("export_failed", "queue_full")
    )


def _counter(client: TestClient, series: str) -> float:
    for line in client.get("/metrics", headers=RD).text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize(
    ("endpoint", "env", "on"),
    [
        ("", {}, False),
        ("http://c:4318/v1/traces", {}, True),
        ("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, True),
        ("", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, True),
        ("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"}, False),
    ],
)
def test_export_is_off_unless_an_endpoint_is_set(endpoint, env, on):
    assert export_enabled(endpoint, env) is on


def test_a_protocol_other_than_http_protobuf_is_refused_naming_the_variable():
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_PROTOCOL"):
        export_enabled("http://c:4318/v1/traces", {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    assert export_enabled(
        "http://c:4318/v1/traces",
        {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
    )
