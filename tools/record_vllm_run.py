"""Record a real-vLLM run for the dashboard tests: every event batch the plugin and the gateway POSTed
to the ledger, as they sent it.

    .venv/bin/python -m tools.record_vllm_run          # writes tests/dashboard/data/vllm_run.jsonl.gz
    .venv/bin/python -m tools.record_vllm_run --out /tmp/run.jsonl.gz --short 60 --waves 4

The stack, all on free ports and stopped on exit (as ``bench/agreement.py`` runs it): a ledger
(``chunkledger serve``, DuckDB in a temp dir) with its default policy; a capturing proxy in front of it
(in this process); vLLM's OpenAI API server with ``engine_hooks.vllm.LedgerScheduler`` on the tiny
random-weight Llama (:func:`engine_hooks.vllm.tiny_model.build_tiny_model`, the CPU settings of
:func:`engine_hooks.vllm.cpu.engine_settings`: fp32, one OpenMP thread, the uni executor), reporting to
the proxy; and the gateway (``chunkledger gateway``) in front of vLLM, reporting to the proxy too.
vLLM gets a small KV cache (``--kv-cache-tokens``, default 2048 tokens: 16 blocks of 128) and
``--no-scheduler-reserve-full-isl``, so that the burst of short requests preempts (the default run
preempts well over 10 times), and a 256-token budget, so that the long prompts are prefilled in
chunks beside the short requests' decodes.

The requests (streamed ``/v1/completions`` through the gateway, ``x-request-id: vllm-...``, random
token ids as prompts so that nothing hits the prefix cache, ``ignore_eos``, temperature 0): ``--short``
short ones (96..160 prompt tokens, 96..200 output tokens) in ``--waves`` waves ``--wave-gap-s`` apart
(the tiny model runs a step in a few milliseconds: only a wave sent at once fills the KV cache),
``--long`` long prompts (``--long-len`` tokens) among them, and one runaway: a request
for ``--runaway-tokens`` output tokens whose prompt repeats a short block; the random-weight model
answers it greedily with a repeating tail, which the ledger's loop rule cuts (the engine aborts it,
the gateway cuts its stream).

The proxy forwards every request to the ledger unchanged (POST /v1/events, the command long-polls)
and keeps each POST /v1/events body the ledger accepted (2xx), in the order they arrived. The output
is gzip JSON lines: one line per batch, the body exactly as it was POSTed (``{"source": ...,
"events": [...], "schema_version": ...}``). ``tests/dashboard/conftest.py`` replays it into a fresh
ledger through the real ``POST /v1/events``, with the timestamps shifted to the present.

A summary (requests, preemptions, cutoffs, batches, size) goes to stderr; the run takes about two
minutes on two cores (most of it vLLM's start).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import os
import random
import sys
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from bench.toolkit import Proc, free_port, stop_all, vllm_server_cmd

ROOT = Path(__file__).resolve().parent.parent


DEFAULT_OUT = ROOT / "tests" / "dashboard" / "data" / "vllm_run.jsonl.gz"
MODEL_NAME = "tiny"
MODEL_LAYERS, MODEL_KV_HIDDEN = 2, 128  # build_tiny_model's defaults
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "content-encoding"}


def log(msg: str) -> None:
    print(f"[record] {msg}", file=sys.stderr, flush=True)


class CaptureProxy:
    """A threaded HTTP proxy to the ledger that keeps the bodies of accepted ``POST /v1/events``."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.batches: list[bytes] = []
        self._lock = threading.Lock()
        self._client = httpx.Client(timeout=httpx.Timeout(90.0, connect=5.0))
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
                try:
                    r = proxy._client.request(
                        self.command, proxy.upstream + self.path, content=body, headers=headers
                    )
                except httpx.HTTPError as exc:
                    raw = json.dumps({"detail": f"proxy: {exc}"}).encode()
                    self.send_response(502)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(raw)))
                    self.end_headers()
                    self.wfile.write(raw)
                    return
                if self.command == "POST" and self.path.split("?")[0] == "/v1/events" and r.is_success:
                    with proxy._lock:
                        proxy.batches.append(body)
                self.send_response(r.status_code)
                for k, v in r.headers.items():
                    if k.lower() not in HOP_HEADERS:
                        self.send_header(k, v)
                self.send_header("content-length", str(len(r.content)))
                self.end_headers()
                self.wfile.write(r.content)

            def _serve(self) -> None:
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # a source shut down
                    self._forward()

            do_GET = do_POST = do_PUT = do_DELETE = _serve

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._client.close()


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(300, 1390) for _ in range(n)]


async def _one(client: httpx.AsyncClient, gateway: str, rid: str, prompt: list[int], max_tokens: int) -> str:
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0,
    }
    try:
        async with client.stream(
            "POST", f"{gateway}/v1/completions", json=body, headers={"x-request-id": rid}
        ) as r:
            async for _ in r.aiter_bytes():
                pass
            return str(r.status_code)
    except httpx.HTTPError as exc:
        return type(exc).__name__


async def _drive(gateway: str, args: argparse.Namespace) -> dict[str, int]:
    rng = random.Random(args.seed)
    plan: list[tuple[float, str, list[int], int]] = []
    for i in range(args.short):  # waves of requests sent at once, a little jitter inside a wave
        at = (i % args.waves) * args.wave_gap_s + rng.uniform(0.0, 0.2)
        plan.append((at, f"vllm-s{i:03d}", _prompt(rng, rng.randint(96, 160)), rng.randint(96, 200)))
    for i in range(args.long):
        at = ((i + 1) % args.waves) * args.wave_gap_s + 0.1
        plan.append((at, f"vllm-long{i}", _prompt(rng, args.long_len), 16))
    if args.runaway_tokens:
        block = _prompt(rng, 6)
        plan.append(
            (min(2, args.waves - 1) * args.wave_gap_s, "vllm-runaway", block * 12, args.runaway_tokens)
        )
    plan.sort()
    limits = httpx.Limits(max_connections=len(plan) + 4, max_keepalive_connections=len(plan) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), limits=limits) as client:
        t0 = time.monotonic()

        async def at(delay: float, rid: str, prompt: list[int], n: int) -> str:
            await asyncio.sleep(max(0.0, t0 + delay - time.monotonic()))
            return await _one(client, gateway, rid, prompt, n)

        codes = await asyncio.gather(*(at(*p) for p in plan))
    out: dict[str, int] = {}
    for c in codes:
        out[c] = out.get(c, 0) + 1
    return out


def _settled(ledger: str, n: int, timeout: float = 60.0) -> dict[str, Any]:
    """Wait until every request has ended in the ledger (engine finish and gateway completion)."""
    deadline = time.monotonic() + timeout
    sql = (
        "SELECT count(*) AS n, count(end_ts) AS ended, count(finished_ts) AS finished, "
        "count(completed_ts) AS completed, sum(preemptions) AS preemptions FROM requests "
        "WHERE request_id LIKE 'vllm-%'"
    )
    row: dict[str, Any] = {}
    while time.monotonic() < deadline:
        ans = httpx.post(f"{ledger}/v1/sql", json={"sql": sql}, timeout=30).json()
        row = dict(zip(ans["columns"], ans["rows"][0], strict=True))
        if row["n"] >= n and row["finished"] >= n and row["completed"] >= n:
            break
        time.sleep(0.5)
    return row


def record(args: argparse.Namespace) -> dict[str, Any]:
    from engine_hooks.vllm.cpu import engine_settings
    from engine_hooks.vllm.tiny_model import build_tiny_model, vllm_env

    settings = engine_settings()  # fp32, one OpenMP thread, the uni executor
    work = Path(tempfile.mkdtemp(prefix="chunkledger-rec-", dir="/tmp" if os.path.isdir("/tmp") else None))
    procs: list[Proc] = []
    proxy: CaptureProxy | None = None
    tag = uuid.uuid4().hex[:6]
    try:
        model = build_tiny_model(args.model_dir or work / "tiny-llama")
        ledger_port, vllm_port, gw_port = free_port(), free_port(), free_port()
        ledger, vllm, gateway = (f"http://127.0.0.1:{p}" for p in (ledger_port, vllm_port, gw_port))
        ledger_cmd = [
            sys.executable, "-m", "chunkledger", "serve",
            "--db", f"duckdb:///{work / 'ledger.duckdb'}", "--port", str(ledger_port),
        ]  # fmt: skip
        procs.append(Proc("ledger", ledger_cmd, work / "ledger.log", dict(os.environ)))
        procs[0].wait_ready(ledger + "/readyz", 60)
        proxy = CaptureProxy(ledger)
        kv_bytes = args.kv_cache_tokens * settings.kv_bytes_per_token(MODEL_LAYERS, MODEL_KV_HIDDEN)
        vllm_cmd = vllm_server_cmd(
            model,
            vllm_port,
            served_name=MODEL_NAME,
            engine_args=settings.cli_args(),
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.budget,
            kv_cache_memory_bytes=kv_bytes,
            no_scheduler_reserve_full_isl=True,
        )
        exp_env = {"CHUNKLEDGER_SPOOL_FSYNC": "0", "CHUNKLEDGER_FLUSH_INTERVAL_S": "0.05"}
        procs.append(
            Proc(
                "vllm",
                vllm_cmd,
                work / "vllm.log",
                {
                    **os.environ,
                    **vllm_env(work / "vllm"),
                    **settings.env,
                    **exp_env,
                    "CHUNKLEDGER_URL": proxy.url,
                    "CHUNKLEDGER_SOURCE_ID": f"vllm-{tag}",
                    "CHUNKLEDGER_SPOOL_DIR": str(work / "spool-vllm"),
                },
            )
        )
        gw_cmd = [
            sys.executable, "-m", "chunkledger", "gateway",
            "--upstream", vllm, "--port", str(gw_port), "--ledger", proxy.url,
            "--source-id", f"gw-{tag}", "--log-level", "warning",
        ]  # fmt: skip
        procs.append(
            Proc(
                "gateway",
                gw_cmd,
                work / "gateway.log",
                {**os.environ, **exp_env, "CHUNKLEDGER_SPOOL_DIR": str(work / "spool-gw")},
            )
        )
        procs[2].wait_ready(gateway + "/healthz", 60)
        procs[1].wait_ready(vllm + "/v1/models", 600)
        log("stack ready; sending requests")
        started = time.monotonic()
        codes = asyncio.run(_drive(gateway, args))
        log(f"clients done in {time.monotonic() - started:.1f} s: {codes}")
        n = args.short + args.long + (1 if args.runaway_tokens else 0)
        row = _settled(ledger, n)
        time.sleep(2.0)  # the last steps and confirmations on their way
        cut = httpx.get(f"{ledger}/v1/cutoffs", params={"limit": 1000}, timeout=30).json()["cutoffs"]
        batches = list(proxy.batches)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(args.out, "wb", compresslevel=9) as f:
            for body in batches:
                f.write(body.replace(b"\n", b" ") + b"\n")
        return {
            "requests": row,
            "http": codes,
            "cutoffs": sorted({(c["rule"], c["action"], c["state"]) for c in cut}),
            "batches": len(batches),
            "events": sum(len(json.loads(b)["events"]) for b in batches),
            "bytes": args.out.stat().st_size,
            "out": str(args.out),
        }
    finally:
        if proxy is not None:
            with contextlib.suppress(Exception):
                proxy.close()
        stop_all(procs, work, keep=args.keep)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the recording")
    ap.add_argument("--short", type=int, default=80, help="short requests")
    ap.add_argument("--waves", type=int, default=5, help="the short requests come in this many waves")
    ap.add_argument("--wave-gap-s", type=float, default=4.0, help="seconds between waves")
    ap.add_argument("--long", type=int, default=3, help="long prompts among them")
    ap.add_argument("--long-len", type=int, default=1500, help="tokens of each long prompt")
    ap.add_argument("--runaway-tokens", type=int, default=400, help="the runaway's max_tokens (0: none)")
    ap.add_argument("--kv-cache-tokens", type=int, default=2048, help="vLLM's KV cache, in tokens")
    ap.add_argument("--budget", type=int, default=256, help="vLLM's max_num_batched_tokens")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=1792, help="under the KV cache")
    ap.add_argument("--seed", type=int, default=20)
    ap.add_argument("--model-dir", default="", help="where to build/reuse the tiny model (default: temp)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs, database)")
    args = ap.parse_args(argv)
    summary = record(args)
    print(json.dumps(summary, indent=2, default=str), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
