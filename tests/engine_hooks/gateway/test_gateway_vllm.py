"""The gateway in front of the real vLLM OpenAI server (tiny random-weight model on CPU), reporting to
the real ledger, with the engine running chunkledger's scheduler plugin (``LedgerScheduler``).

One ledger and one vLLM server for the module (vLLM takes about 20-80 s to start here).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.toolkit import free_port, vllm_server_cmd
from tests.support.fake_ledger import wait_until
from tests.support.otlp_receiver import OtlpReceiver

# pytest-timeout counts fixture setup: the first test pays for starting the ledger (60 s at most) and
# vLLM (300 s at most), whose own deadlines should fire first, with the server's log in the message.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(480)]

MODEL = "tiny"


class Proc:
    def __init__(self, args: list[str], log: Path, env: dict[str, str], ready_url: str, timeout: float):
        self.log = log
        self.proc = subprocess.Popen(args, stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env)  # noqa: SIM115
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{args[:4]} exited with {self.proc.returncode}: {log.read_text()[-3000:]}"
                )
            try:
                if httpx.get(ready_url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{args[:4]} not ready in {timeout}s: {log.read_text()[-3000:]}")
            time.sleep(0.25)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A real ledger and a real vLLM OpenAI server whose engine reports to it."""
    from engine_hooks.vllm.cpu import engine_settings
    from engine_hooks.vllm.tiny_model import build_tiny_model, vllm_env

    settings = engine_settings()

    base = tmp_path_factory.mktemp("gateway-vllm")
    model = build_tiny_model(base / "tiny-llama")
    # One OTLP/HTTP receiver for vLLM's own spans (--otlp-traces-endpoint) and the ledger's.
    receiver = OtlpReceiver()
    ledger_port, vllm_port = free_port(), free_port()
    ledger_url = f"http://127.0.0.1:{ledger_port}"
    ledger = Proc(
        [
            sys.executable,
            "-m",
            "chunkledger",
            "serve",
            "--db",
            f"duckdb:///{base / 'ledger.duckdb'}",
            "--port",
            str(ledger_port),
        ],
        base / "ledger.log",
        {**os.environ, "CHUNKLEDGER_OTLP_TRACES_ENDPOINT": receiver.url, "CHUNKLEDGER_TRACES_DELAY_S": "0.2"},
        ledger_url + "/readyz",
        60,
    )
    env = {
        **os.environ,
        **vllm_env(base / "env"),
        **settings.env,
        "CHUNKLEDGER_URL": ledger_url,
        "CHUNKLEDGER_SOURCE_ID": "vllm-gw-test",
        "CHUNKLEDGER_SPOOL_DIR": str(base / "spool"),
        "CHUNKLEDGER_SPOOL_FSYNC": "0",
        "CHUNKLEDGER_FLUSH_INTERVAL_S": "0.02",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",  # vLLM's default is gRPC
        "OTEL_BSP_SCHEDULE_DELAY": "200",  # ms: vLLM's batch span processor sends soon
    }
    try:
        vllm = Proc(
            vllm_server_cmd(
                model,
                vllm_port,
                served_name=MODEL,
                engine_args=settings.cli_args(),
                max_model_len=2048,
                max_num_seqs=16,
                kv_cache_memory_bytes=8 << 20,
                otlp_traces_endpoint=receiver.url,
            ),
            base / "vllm.log",
            env,
            f"http://127.0.0.1:{vllm_port}/v1/models",
            300,
        )
    except BaseException:
        ledger.stop()
        receiver.stop()
        raise
    yield {"ledger": ledger_url, "vllm": f"http://127.0.0.1:{vllm_port}", "receiver": receiver}  # type: ignore[misc]
    vllm.stop()
    ledger.stop()
    receiver.stop()


def _row(ledger: str, request_id: str) -> dict[str, Any] | None:
    answer = httpx.get(f"{ledger}/v1/requests/{request_id}", timeout=5)
    return answer.json()["request"] if answer.status_code == 200 else None


class RecordingRelay:
    """A TCP relay in a thread between the gateway and vLLM that keeps every byte vLLM sent back."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.received = bytearray()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self._pipe, args=(client, upstream, None), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, self.received), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, record: bytearray | None) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if record is not None:
                    record.extend(data)
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._sock.close()


def _dechunk(raw: bytes) -> bytes:
    """The body of one HTTP/1.1 response with chunked transfer encoding."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower(), head
    body = bytearray()
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return bytes(body)
        body.extend(rest[:size])
        rest = rest[size + 2 :]


def _content(stream: bytes) -> tuple[str, list[Any]]:
    """The text a chat stream carried and its finish reasons (chunking into events varies by timing)."""
    text, reasons = "", []
    for event in stream.split(b"\n\n"):
        if event.startswith(b"data: {"):
            for choice in json.loads(event[6:])["choices"]:
                text += choice["delta"].get("content") or ""
                reasons.append(choice["finish_reason"])
    return text, [r for r in reasons if r]


CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "the ledger and the engine"}],
    "temperature": 0,
}


def test_vllm_stream_passes_through_byte_for_byte_and_matches_the_direct_stream(stack, make_gateway):
    relay = RecordingRelay(int(stack["vllm"].rsplit(":", 1)[1]))
    try:
        gw = make_gateway(f"http://127.0.0.1:{relay.port}", ledger_url=stack["ledger"])
        body = {**CHAT, "stream": True, "max_tokens": 12}
        with httpx.Client(timeout=60) as client:
            via = client.post(
                gw.url + "/v1/chat/completions", json=body, headers={"x-request-id": "vllm-via-1"}
            )
            direct = client.post(
                stack["vllm"] + "/v1/chat/completions", json=body, headers={"x-request-id": "vllm-dir-1"}
            )
    finally:
        relay.close()
    assert via.status_code == direct.status_code == 200
    assert via.headers["x-request-id"] == "vllm-via-1"
    assert b'"id":"chatcmpl-vllm-via-1"' in via.content  # vLLM took the gateway's request id
    assert via.content == _dechunk(bytes(relay.received))  # exactly the bytes vLLM sent the gateway
    assert via.content.endswith(b"data: [DONE]\n\n")
    assert _content(via.content) == _content(direct.content)  # greedy: the same text, the same ending


def test_vllm_ledger_row_joins_gateway_and_engine_layers(stack, make_gateway):
    gw = make_gateway(stack["vllm"], ledger_url=stack["ledger"])
    with httpx.Client(timeout=60) as client:
        r = client.post(
            gw.url + "/v1/completions",
            json={"model": MODEL, "prompt": "prefill decode chunk budget", "max_tokens": 9, "temperature": 0},
            headers={"x-request-id": "vllm-join-1"},
        )
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    gw.flush()

    def joined() -> bool:
        row = _row(stack["ledger"], "vllm-join-1")
        return bool(row and row["engine_source_id"] and row["completed_ts"] and row["finished_ts"])

    assert wait_until(joined, timeout=20)
    row = _row(stack["ledger"], "vllm-join-1")
    assert row is not None
    assert (row["gateway_source_id"], row["engine_source_id"]) == ("gw-test", "vllm-gw-test")
    for column in (
        "arrived_ts",
        "admission_enqueued_ts",
        "admitted_ts",
        "queued_ts",
        "first_scheduled_ts",
        "first_token_ts",
        "finished_ts",
        "first_byte_ts",
        "completed_ts",
    ):
        assert row[column] is not None, column
    assert row["finish_reason"] == "length" and row["output_tokens"] == 9 and row["status_code"] == 200
    assert row["prompt_tokens"] > 0


def test_vllm_client_disconnect_aborts_the_engine_request(stack, make_gateway):
    gw = make_gateway(stack["vllm"], ledger_url=stack["ledger"])
    with (
        httpx.Client(timeout=60) as client,
        client.stream(
            "POST",
            gw.url + "/v1/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 480, "stream": True, "ignore_eos": True},
            headers={"x-request-id": "vllm-leave-1"},
        ) as response,
    ):
        for i, _chunk in enumerate(response.iter_raw()):
            if i == 2:
                break
    gw.flush()

    def aborted() -> bool:
        row = _row(stack["ledger"], "vllm-leave-1")
        return bool(row and row["finish_reason"])

    assert wait_until(aborted, timeout=30)
    row = _row(stack["ledger"], "vllm-leave-1")
    assert row is not None
    assert row["finish_reason"] == "abort"  # the engine's own report: vLLM aborted it
    assert row["output_tokens"] < 480
    assert row["disconnected_ts"] is not None


def test_vllm_ledger_cutoff_cuts_the_stream_and_the_engine_request(stack, make_gateway):
    gw = make_gateway(stack["vllm"], ledger_url=stack["ledger"], command_poll_wait_s=5)
    with httpx.Client(timeout=60) as client:
        assert (
            client.put(stack["ledger"] + "/v1/policy", json={"rules": {"max_output_tokens": 6}}).status_code
            == 200
        )
        try:
            r = client.post(
                gw.url + "/v1/completions",
                json={"model": MODEL, "prompt": "hi", "max_tokens": 2000, "stream": True, "ignore_eos": True},
                headers={"x-request-id": "vllm-cut-1"},
            )
        finally:
            client.put(stack["ledger"] + "/v1/policy", json={})
        cutoffs = client.get(stack["ledger"] + "/v1/cutoffs", params={"request_id": "vllm-cut-1"}).json()[
            "cutoffs"
        ]
    events = [e for e in r.content.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    row = _row(stack["ledger"], "vllm-cut-1")
    assert len(chunks) < 1500, (cutoffs, row)  # cut long before 2000 tokens (the decision takes a few steps)
    last = chunks[-1]
    # Whichever applied the command first ends the stream: the gateway (its final chunk names the rule)
    # or the engine (vLLM finishes the request with stop reason chunkledger:token_cap).
    if "error" in last:
        assert last["error"]["code"] == "token_cap" and last["choices"][0]["finish_reason"] == "cutoff"
    else:
        assert last["choices"][0]["finish_reason"] is not None
    assert [c["rule"] for c in cutoffs] == ["token_cap"]
    gw.flush()
    assert wait_until(
        lambda: (_row(stack["ledger"], "vllm-cut-1") or {}).get("cut_rule") == "token_cap", timeout=20
    )


def test_vllm_routes_answer_through_the_gateway_as_vllm_answers_them(stack, make_gateway):
    gw = make_gateway(stack["vllm"])
    with httpx.Client(timeout=30) as client:
        for method, path, body in (
            ("GET", "/health", None),
            ("GET", "/version", None),
            ("GET", "/v1/models", None),
            ("POST", "/tokenize", {"model": MODEL, "prompt": "the ledger"}),
        ):
            via = client.request(method, gw.url + path, json=body)
            direct = client.request(method, stack["vllm"] + path, json=body)
            assert via.status_code == direct.status_code == 200, path
            if path == "/v1/models":  # each answer has its own creation time and permission ids
                assert [m["id"] for m in via.json()["data"]] == [m["id"] for m in direct.json()["data"]]
            else:
                assert via.content == direct.content, path


def test_vllm_one_trace_holds_the_gateway_span_vllms_llm_request_and_the_ledgers_layers(stack, make_gateway):
    """The client's trace through the gateway into vLLM (exporting its own spans) and the ledger
    (exporting the request's): the gateway's span under the client's, vLLM's llm_request under the
    gateway's, the layers under the gateway's and adding up to it."""
    receiver: OtlpReceiver = stack["receiver"]
    trace, client_span = "5bf92f3577b34da6a3ce929d0e0e4737", "10f067aa0ba902b8"
    gw = make_gateway(stack["vllm"], ledger_url=stack["ledger"])
    with httpx.Client(timeout=60) as client:
        r = client.post(
            gw.url + "/v1/completions",
            json={"model": MODEL, "prompt": "traced end to end", "max_tokens": 6, "temperature": 0},
            headers={"x-request-id": "vllm-traced-1", "traceparent": f"00-{trace}-{client_span}-01"},
        )
    assert r.status_code == 200
    gw.flush()
    names = ("llm_request", "entry", "admission", "frontend", "engine_queue", "prefill", "decode")

    def complete() -> bool:
        got = {s.name for s in receiver.of_trace(trace)}
        return set(names) <= got and f"text_completion {MODEL}" in got

    assert wait_until(complete, timeout=30), sorted({s.name for s in receiver.of_trace(trace)})
    spans = receiver.of_trace(trace)
    (request,) = [s for s in spans if s.name == f"text_completion {MODEL}"]
    (llm,) = [s for s in spans if s.name == "llm_request"]
    assert request.parent_span_id == client_span
    assert llm.parent_span_id == request.span_id  # the gateway's span is vLLM's parent
    assert (
        llm.attributes["gen_ai.usage.completion_tokens"]
        == request.attributes["gen_ai.usage.output_tokens"]
        == 6
    )
    layers = sorted(
        (s for s in spans if s.parent_span_id == request.span_id and s.name != "llm_request"),
        key=lambda s: s.start_ns,
    )
    assert [s.name for s in layers] == list(names[1:])
    assert layers[0].start_ns == request.start_ns and abs(layers[-1].end_ns - request.end_ns) <= 1000
    assert abs(sum(s.duration_ns for s in layers) - request.duration_ns) <= 1000
    row = _row(stack["ledger"], "vllm-traced-1")
    assert row is not None and (row["trace_id"], row["parent_span_id"], row["span_id"]) == (
        trace,
        client_span,
        request.span_id,
    )
