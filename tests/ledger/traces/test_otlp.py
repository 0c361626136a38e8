"""The OTLP/HTTP sender against a real receiver: the standard variables, gzip, retries, giving up."""

from __future__ import annotations

import time

import pytest
from opentelemetry.sdk.resources import Resource

from ledger.traces.otlp import OtlpHttpSender, SenderConfig, encode, parse_headers
from ledger.traces.spans import Span, SpanEvent
from tests.support.otlp_receiver import OtlpReceiver

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPANS = [
    (
        TRACE,
        Span(
            "chat m",
            "b7ad6b7169203331",
            "00f067aa0ba902b7",
            10.0,
            11.5,
            {"gen_ai.usage.output_tokens": 3},
            server=True,
        ),
    ),
    (
        TRACE,
        Span(
            "prefill",
            "1111111111111111",
            "b7ad6b7169203331",
            10.0,
            10.5,
            {},
            [SpanEvent("prefill_chunk", 10.2, {"chunkledger.tokens": 128})],
            error="x",
        ),
    ),
]


def _sent(receiver: OtlpReceiver, env: dict[str, str]) -> bool:
    sender = OtlpHttpSender(
        SenderConfig.resolve("", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url, **env})
    )
    try:
        return sender.send(encode(SPANS, Resource.create({"service.name": "svc"})))
    finally:
        sender.close()


def test_spans_arrive_decoded_with_headers_and_gzip_from_the_standard_variables():
    receiver = OtlpReceiver()
    try:
        env = {
            "OTEL_EXPORTER_OTLP_HEADERS": "api-key=s%20ecret,x-team=llm",
            "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": "gzip",
        }
        assert _sent(receiver, env)
    finally:
        receiver.stop()
    (headers,) = receiver.headers
    assert (
        headers["api-key"] == "s ecret"
        and headers["x-team"] == "llm"
        and headers["content-encoding"] == "gzip"
    )
    request, prefill = receiver.spans
    assert (request.trace_id, request.span_id, request.parent_span_id, request.kind) == (
        TRACE,
        "b7ad6b7169203331",
        "00f067aa0ba902b7",
        2,
    )
    assert request.start_ns == 10_000_000_000 and request.end_ns == 11_500_000_000
    assert (
        request.attributes == {"gen_ai.usage.output_tokens": 3} and request.resource["service.name"] == "svc"
    )
    assert prefill.events == [("prefill_chunk", 10_200_000_000, {"chunkledger.tokens": 128})]
    assert prefill.status_code == 2  # ERROR
    assert request.scope == "chunkledger"


def test_a_busy_endpoint_is_retried_after_its_retry_after_and_a_refusal_is_not():
    busy = OtlpReceiver(first=[503, 429], retry_after="0.1")
    try:
        assert _sent(busy, {"OTEL_EXPORTER_OTLP_TIMEOUT": "5"})
    finally:
        busy.stop()
    assert len(busy.times) == 3 and len(busy.spans) == 2
    assert 0.08 <= busy.times[1] - busy.times[0] < 1.0  # Retry-After, not the 1 s backoff
    refusing = OtlpReceiver(status=400)
    try:
        assert not _sent(refusing, {"OTEL_EXPORTER_OTLP_TIMEOUT": "5"})
    finally:
        refusing.stop()
    assert len(refusing.times) == 1


def test_an_endpoint_that_stays_down_is_given_up_on_after_the_timeout():
    dead = OtlpReceiver(status=503)
    try:
        started = time.monotonic()
        assert not _sent(dead, {"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "1.5"})
        took = time.monotonic() - started
    finally:
        dead.stop()
    assert 0.5 < took <= 1.6 and 2 <= len(dead.times) <= 3  # tries at 0, ~1 s; ~3 s is past the timeout


@pytest.mark.parametrize(
    ("env", "endpoint"),
    [
        ({}, "http://localhost:4318/v1/traces"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}, "http://c:4318/v1/traces"),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t/x",
            },
            "http://t/x",
        ),
    ],
)
def test_the_endpoint_resolves_as_the_sdk_resolves_it(env, endpoint):
    assert SenderConfig.resolve("", env).endpoint == endpoint
    assert SenderConfig.resolve("http://set/v1/traces", env).endpoint == "http://set/v1/traces"


@pytest.mark.parametrize(
    ("name", "value"), [("OTEL_EXPORTER_OTLP_TIMEOUT", "soon"), ("OTEL_EXPORTER_OTLP_COMPRESSION", "zstd")]
)
def test_bad_settings_are_refused_naming_the_variable(name, value):
    with pytest.raises(ValueError, match=name):
        SenderConfig.resolve("http://c/v1/traces", {name: value})


def test_header_pairs_without_a_key_are_skipped():
    assert parse_headers("a=1,broken,=x, b = 2 ") == {"a": "1", "b": "2"}


def test_the_ca_file_and_client_certificate_variables_make_the_tls_context(tmp_path):
    import ssl
    import subprocess

    assert SenderConfig.resolve("https://c/v1/traces", {}).tls() is True
    key, cert = tmp_path / "client.key", tmp_path / "client.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=client", "-days", "1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    env = {
        "OTEL_EXPORTER_OTLP_CERTIFICATE": str(cert),
        "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE": str(cert),
        "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY": str(key),
    }
    context = SenderConfig.resolve("https://c/v1/traces", env).tls()
    assert isinstance(context, ssl.SSLContext)
    assert [c["subject"] for c in context.get_ca_certs()] == [((("commonName", "client"),),)]
    OtlpHttpSender(SenderConfig.resolve("https://c/v1/traces", env)).close()  # httpx takes the context
    with pytest.raises(FileNotFoundError):
        SenderConfig.resolve(
            "https://c/v1/traces", {"OTEL_EXPORTER_OTLP_CERTIFICATE": str(tmp_path / "none.pem")}
        ).tls()
