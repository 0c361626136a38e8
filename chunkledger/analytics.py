"""``chunkledger attribution | requests | why | stalls``: the analytics queries from a terminal.

They read through a running ledger's HTTP API (``--ledger``, env CHUNKLEDGER_LEDGER_URL; read token
from ``--token`` or CHUNKLEDGER_READ_TOKEN). Latencies print in milliseconds, tails first; a mean is
only printed to the right of the p99.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any

import typer

from chunkledger.options import LedgerUrlOpt, ReadTokenOpt
from ledger.analytics.why_answer import TOP_DEFAULT
from ledger.defaults import DEFAULT_LEDGER_URL

FormatOpt = Annotated[str, typer.Option("--format", help="table or json")]
SinceOpt = Annotated[str | None, typer.Option(help="unix seconds, ISO 8601, or an age: 15m, 2h, 1d")]


def _call(ledger: str | None, token: str | None, path: str, **params: Any) -> Any:
    from ledger.client import LedgerClient, LedgerError  # httpx: loaded only when a command runs

    try:
        with LedgerClient(ledger, token) as c:
            return c.get(path, **params)
    except LedgerError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None


def _ms(v: Any) -> str:
    return "" if v is None else f"{v * 1e3:.1f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Aligned plain-text table; numbers right-aligned."""
    cells = [[("" if v is None else str(v)) for v in r] for r in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]

    def fmt(vals: Sequence[str], raw: Sequence[Any] | None = None) -> str:
        out = []
        for i, v in enumerate(vals):
            numeric = raw is not None and isinstance(raw[i], int | float) and not isinstance(raw[i], bool)
            numeric = numeric or (raw is not None and _looks_numeric(v))
            out.append(v.rjust(widths[i]) if numeric else v.ljust(widths[i]))
        return "  ".join(out).rstrip()

    lines = [fmt(list(headers)), "  ".join("-" * w for w in widths)]
    lines += [fmt(c, r) for c, r in zip(cells, rows, strict=True)]
    return "\n".join(lines)


def _looks_numeric(v: str) -> bool:
    try:
        float(v)
    except ValueError:
        return False
    return True


def attribution(
    since: SinceOpt = "1h",
    until: SinceOpt = None,
    by: Annotated[
        str, typer.Option(help="group by: model, engine_source_id, gateway_source_id, finish_reason")
    ] = "",
    ledger: LedgerUrlOpt = DEFAULT_LEDGER_URL,
    token: ReadTokenOpt = None,
    fmt: FormatOpt = "table",
) -> None:
    """Per-layer latency tails (ms) of the requests that finished in the window, and decode ITL."""
    out = _call(ledger, token, "/v1/attribution", since=since, until=until, group_by=by)
    if fmt == "json":
        typer.echo(json.dumps(out, indent=2))
        return
    if not out["groups"]:
        typer.echo("no finished requests in the window")
    for g in out["groups"]:
        label = ", ".join(f"{k}={g[k]}" for k in out["group_by"]) or "all requests"
        typer.echo(
            f"\n{label}: {g['requests']} requests, {g['output_tokens']} output tokens, "
            f"{g['preemptions']} preemptions"
        )
        rows = []
        for layer, s in g["layers"].items():  # in the API's order: entry, admission, ... (METRICS)
            rows.append(
                [layer.removesuffix("_s"), s["n"], *(_ms(s[k]) for k in ("p50", "p90", "p99", "max", "mean"))]
            )
        typer.echo(table(["layer (ms)", "n", "p50", "p90", "p99", "max", "mean"], rows))
    for i in out["itl"]:
        label = f" ({i['model']})" if "model" in i else ""
        typer.echo(
            f"\ndecode ITL{label}: n={i['n']} p50={_ms(i['p50'])} p90={_ms(i['p90'])} p99={_ms(i['p99'])} "
            f"max={_ms(i['max'])} mean={_ms(i['mean'])} ms"
        )


def requests(
    sort: Annotated[str, typer.Option(help="any column of the requests view")] = "e2e_s",
    asc: Annotated[bool, typer.Option("--asc", help="ascending (default: descending)")] = False,
    limit: int = 20,
    live: Annotated[bool | None, typer.Option("--live/--finished", help="only live / only finished")] = None,
    model: str | None = None,
    since: SinceOpt = None,
    ledger: LedgerUrlOpt = DEFAULT_LEDGER_URL,
    token: ReadTokenOpt = None,
    fmt: FormatOpt = "table",
) -> None:
    """Requests sorted by any column (default: slowest end to end first)."""
    out = _call(
        ledger,
        token,
        "/v1/requests",
        sort=sort,
        order="asc" if asc else "desc",
        limit=limit,
        live=live,
        model=model,
        since=since,
    )
    if fmt == "json":
        typer.echo(json.dumps(out, indent=2))
        return
    cols = [
        "request_id",
        "model",
        "finish_reason",
        "ttft_s",
        "e2e_s",
        "entry_s",
        "admission_s",
        "backend_wait_s",
        "prefill_s",
        "decode_s",
        "output_tokens",
        "preemptions",
    ]
    rows = [
        [
            r["request_id"],
            r["model"],
            r["finish_reason"],
            *(_ms(r[c]) for c in cols[3:10]),
            r["output_tokens"],
            r["preemptions"],
        ]
        for r in out["rows"]
    ]
    heads = [c.removesuffix("_s") + (" ms" if c.endswith("_s") else "") for c in cols]
    typer.echo(table(heads, rows))
    typer.echo(f"{len(rows)} of {out['total']} (sorted by {out['sort']})")


def why(
    request_id: str,
    top: Annotated[int, typer.Option(help="culprits named per delay (1-50)")] = TOP_DEFAULT,
    ledger: LedgerUrlOpt = DEFAULT_LEDGER_URL,
    token: ReadTokenOpt = None,
    fmt: FormatOpt = "table",
) -> None:
    """What delayed one request, biggest first, and the requests behind each delay."""
    query = _why_query(request_id, top)
    out = _call(ledger, token, f"/v1/requests/{query.request_id}/why", top=query.top)
    if fmt == "json":
        typer.echo(json.dumps(out, indent=2))
        return
    layers = "  ".join(f"{k.removesuffix('_s')}={_ms(v)}" for k, v in out["layers"].items())
    typer.echo(
        f"{request_id}: e2e {_ms(out['e2e_s'])} ms, TTFT {_ms(out['ttft_s'])} ms\n  layers (ms): {layers}"
    )
    if not out["items"]:
        typer.echo("  nothing delayed it beyond its own work")
    for i, item in enumerate(out["items"], 1):
        typer.echo(f"{i}. {_ms(item['seconds'])} ms  {item['kind']}: {item['detail']}")
        for c in item["culprits"]:
            held = (
                f", {c['decode_steps']} decode steps, {_ms(c['share_s'])} ms of the steps"
                if "share_s" in c
                else ""
            )
            typer.echo(
                f"     - {c['request_id']}: {c['prefill_tokens']} prefill tokens in {c['chunks']} chunks, "
                f"up to depth {c['max_depth']}{held}"
            )


def _why_query(request_id: str, top: int) -> Any:
    """The question as the API parses it (``WhyQuery``); exit 2 naming the option when it is not one."""
    import msgspec

    from ledger.analytics.why_answer import WhyQuery

    try:
        return msgspec.convert({"request_id": request_id, "top": top}, WhyQuery)
    except msgspec.ValidationError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


def stalls(
    limit: int = 20,
    ledger: LedgerUrlOpt = DEFAULT_LEDGER_URL,
    token: ReadTokenOpt = None,
    fmt: FormatOpt = "table",
) -> None:
    """Live requests ranked by time without progress (KV held idle, or still waiting)."""
    out = _call(ledger, token, "/v1/kv/stalls", limit=limit)
    if fmt == "json":
        typer.echo(json.dumps(out, indent=2))
        return
    rows = [
        [
            r["request_id"],
            r["state"],
            f"{r['stall_s']:.3f}",
            f"{r['kv_idle_s']:.3f}",
            r["kv_blocks_max"],
            r["preemptions"],
            r["output_tokens"],
        ]
        for r in out["requests"]
    ]
    typer.echo(
        table(["request_id", "state", "stalled s", "kv idle s", "kv blocks", "preemptions", "output"], rows)
    )


def register(app: typer.Typer) -> None:
    for fn in (attribution, requests, why, stalls):
        app.command(name=fn.__name__)(fn)
