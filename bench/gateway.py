"""What the gateway costs: added latency per request and streamed tokens/s, proxy vs direct, one run.

Three processes: a fast fake OpenAI upstream (tests/support/fake_upstream.py under uvicorn), the
gateway (``chunkledger gateway``, sending its events to an in-process fake ledger, as in production),
and this client. The client talks raw HTTP/1.1 over keep-alive connections (asyncio streams, no HTTP
library), so that its own cost is small and identical on both paths.

* latency: sequential streamed requests of ``--tokens-latency`` tokens, alternating direct and proxy
  request by request; per request, the time from sending it to the end of ``data: [DONE]``.
  "added" is p50(proxy) - p50(direct) (and the median of the paired differences).
  Also the gateway's CPU time per proxied request over that phase (all its threads, from
  ``/proc/<pid>/task/*/schedstat``; Linux only), which load on the machine inflates far less than latency.
* throughput: ``--streams`` concurrent streams of ``--tokens`` tokens each, all at once, alternating
  direct and proxy rounds; tokens/s over the round's wall time. Run twice: with the upstream pacing
  tokens (``--itl-ms`` per stream on a fixed timeline, like an engine decoding) and unpaced (the
  upstream writes as fast as it can, so the three processes compete for the CPU).

Run: ``python -m bench.gateway`` (about a minute). Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.toolkit import free_port, percentile
from tests.support.fake_ledger import FakeLedger

ROOT = Path(__file__).resolve().parent.parent


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise TimeoutError(url)


class Conn:
    """One keep-alive HTTP/1.1 connection that POSTs a streamed completion and reads it to the end."""

    def __init__(self, port: int):
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)

    async def stream(self, tokens: int, itl_ms: float) -> int:
        """Send one request; return the number of ``data: {`` events received."""
        assert self.reader is not None and self.writer is not None
        body = json.dumps({"model": "m", "stream": True, "max_tokens": tokens, "prompt": "hi"}).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:{self.port}\r\n"
            "content-type: application/json\r\n"
            f"content-length: {len(body)}\r\nx-fake-delay-ms: {itl_ms}\r\n\r\n"
        ).encode()
        self.writer.write(head + body)
        reader = self.reader
        headers = await reader.readuntil(b"\r\n\r\n")
        if not headers.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(headers.decode(errors="replace"))
        events = 0
        if b"transfer-encoding: chunked" not in headers.lower():
            raise RuntimeError("expected a chunked stream")
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return events
            data = await reader.readexactly(size + 2)
            events += data.count(b"data: {")


async def latency(ports: dict[str, int], n: int, tokens: int) -> dict[str, list[float]]:
    conns = {name: Conn(port) for name, port in ports.items()}
    for conn in conns.values():
        await conn.open()
    times: dict[str, list[float]] = {name: [] for name in ports}
    for i in range(n + 20):
        for name in ("direct", "proxy") if i % 2 else ("proxy", "direct"):
            started = time.perf_counter()
            got = await conns[name].stream(tokens, 0)
            elapsed = time.perf_counter() - started
            if got != tokens:
                raise RuntimeError(f"{name}: {got} events, expected {tokens}")
            if i >= 20:  # warm-up: connections, pools, caches
                times[name].append(elapsed)
    return times


async def throughput(port: int, streams: int, tokens: int, itl_ms: float) -> float:
    conns = [Conn(port) for _ in range(streams)]
    await asyncio.gather(*(c.open() for c in conns))
    started = time.perf_counter()
    counts = await asyncio.gather(*(c.stream(tokens, itl_ms) for c in conns))
    elapsed = time.perf_counter() - started
    if sum(counts) != streams * tokens:
        raise RuntimeError(f"got {sum(counts)} events, expected {streams * tokens}")
    return sum(counts) / elapsed


def cpu_seconds(pid: int) -> float | None:
    """CPU time of a process, all threads, in seconds (None where /proc has no schedstat)."""
    total = 0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return total / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=400, help="latency samples per path")
    parser.add_argument("--tokens-latency", type=int, default=16)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--itl-ms", type=float, default=20.0, help="upstream token spacing, paced rounds")
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds per path and mode")
    args = parser.parse_args()

    ledger = FakeLedger()
    up_port, gw_port = free_port(), free_port()
    procs = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            up = subprocess.Popen(
                [
                    sys.executable,
                    str(ROOT / "tests" / "support" / "fake_upstream.py"),
                    "--port",
                    str(up_port),
                ],
                stdout=subprocess.DEVNULL,
            )
            procs.append(up)
            env = {**os.environ, "CHUNKLEDGER_SPOOL_DIR": tmp, "CHUNKLEDGER_SPOOL_FSYNC": "0"}
            gw = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "chunkledger",
                    "gateway",
                    "--upstream",
                    f"http://127.0.0.1:{up_port}",
                    "--port",
                    str(gw_port),
                    "--ledger",
                    ledger.url,
                    "--source-id",
                    "gw-bench",
                    "--max-in-flight",
                    "256",
                    "--log-level",
                    "warning",
                ],
                env=env,
            )
            procs.append(gw)
            wait_ready(f"http://127.0.0.1:{up_port}/v1/models", up)
            wait_ready(f"http://127.0.0.1:{gw_port}/healthz", gw)
            ports = {"direct": up_port, "proxy": gw_port}

            cpu_before = cpu_seconds(gw.pid)
            lat = asyncio.run(latency(ports, args.requests, args.tokens_latency))
            cpu_after = cpu_seconds(gw.pid)
            paired = [p - d for p, d in zip(lat["proxy"], lat["direct"], strict=True)]
            rates: dict[tuple[str, str], list[float]] = {}
            for mode, itl in (("paced", args.itl_ms), ("unpaced", 0.0)):
                for r in range(args.rounds):
                    for name in ("direct", "proxy") if r % 2 == 0 else ("proxy", "direct"):
                        rate = asyncio.run(throughput(ports[name], args.streams, args.tokens, itl))
                        rates.setdefault((mode, name), []).append(rate)
            time.sleep(0.5)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(15)
        ledger.stop()

    ms = 1000.0
    d50, d99 = percentile(lat["direct"], 0.5) * ms, percentile(lat["direct"], 0.99) * ms
    p50, p99 = percentile(lat["proxy"], 0.5) * ms, percentile(lat["proxy"], 0.99) * ms
    added50 = p50 - d50
    paired50 = statistics.median(paired) * ms
    print(f"latency, streamed request of {args.tokens_latency} tokens, {args.requests} per path, alternated")
    print(f"  direct  p50 {d50:7.3f} ms   p99 {d99:7.3f} ms")
    print(f"  proxy   p50 {p50:7.3f} ms   p99 {p99:7.3f} ms")
    print(
        f"  added   p50 {added50:7.3f} ms   p99 {p99 - d99:7.3f} ms   "
        f"(median paired difference {paired50:.3f} ms)"
    )
    # the latency phase sends 20 warm-up requests per path before the measured ones
    cpu_ms = (
        (cpu_after - cpu_before) / (args.requests + 20) * ms
        if cpu_before is not None and cpu_after is not None
        else None
    )
    if cpu_ms is not None:
        print(f"  gateway CPU per proxied request {cpu_ms:.3f} ms (all threads)")
    out: dict[str, Any] = {
        "gateway_cpu_ms_per_request": cpu_ms,
        "latency_ms": {
            "direct_p50": d50,
            "direct_p99": d99,
            "proxy_p50": p50,
            "proxy_p99": p99,
            "added_p50": added50,
            "added_p99": p99 - d99,
            "paired_median": paired50,
        },
        "throughput_tokens_per_s": {},
        "gateway_events_received": len(ledger.rows),
    }
    print(
        f"throughput, {args.streams} concurrent streams x {args.tokens} tokens, {args.rounds} rounds per path"
    )
    for mode in ("paced", "unpaced"):
        direct = statistics.median(rates[(mode, "direct")])
        proxy = statistics.median(rates[(mode, "proxy")])
        label = f"{mode} ({args.itl_ms:g} ms/token/stream)" if mode == "paced" else "unpaced (CPU-bound)"
        print(
            f"  {label:32s} direct {direct:9.0f} tok/s   proxy {proxy:9.0f} tok/s   "
            f"ratio {proxy / direct:.3f}"
        )
        out["throughput_tokens_per_s"][mode] = {"direct": direct, "proxy": proxy, "ratio": proxy / direct}
    goal = added50 <= 1.0 and out["throughput_tokens_per_s"]["paced"]["ratio"] >= 0.95
    print(f"goal (<= 1 ms p50 added, >= 0.95 of direct paced throughput): {'met' if goal else 'NOT met'}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
