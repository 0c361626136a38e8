"""``chunkledger advise`` and ``chunkledger profile`` (registered by ``chunkledger.main``)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer

from chunkledger.options import (
    DbOpt,
    FormatOpt,
    LedgerOrNoneOpt,
    ModelOpt,
    ReadTokenOpt,
    SinceOpt,
    SourceOpt,
    UntilOpt,
)
from chunkledger.reads import answer
from ledger.advice.answer import AdviceQuery, ChunkSizeAdvice
from ledger.advice.report import render_advice, render_refusal

if TYPE_CHECKING:
    from engine_hooks.profile_run import Phase
    from ledger.advice.profile import ProfilePlan

from ledger.advice.defaults import DEFAULT_ARRIVAL_SHARE, DEFAULT_MAX_STEPS, MIN_USEFUL_CHUNK


def advise(
    itl_target_ms: Annotated[
        float, typer.Option("--itl-target-ms", help="inter-token latency p99 to stay within (ms)")
    ],
    ledger: LedgerOrNoneOpt = None,
    db: DbOpt = None,
    model: ModelOpt = None,
    source: SourceOpt = None,
    since: SinceOpt = None,
    until: UntilOpt = None,
    depth: Annotated[
        int | None, typer.Option(help="advise at this prefill depth (default: the p99 seen)")
    ] = None,
    arrival_share: Annotated[
        float,
        typer.Option(help="share of each step's prefill a long prompt leaves to arrivals"),
    ] = DEFAULT_ARRIVAL_SHARE,
    max_steps: Annotated[int, typer.Option(help="newest steps of the window to fit on")] = DEFAULT_MAX_STEPS,
    min_chunk: Annotated[
        int, typer.Option(help="refuse a target that leaves fewer prefill tokens per step")
    ] = MIN_USEFUL_CHUNK,
    token: ReadTokenOpt = None,
    format: FormatOpt = "table",
) -> None:
    """Advise max_num_batched_tokens and long_prefill_token_threshold for an ITL target.

    Fits step time from the ledger's steps (prefill tokens, prefill depth, decode batch) and prints the
    decode time at current load, the prefill budget, the settings, the predicted ITL p99 and the
    prefill throughput they cost, by depth. Exit status 1 when the data cannot support advice.
    """
    query = _advice_query(
        itl_target_ms=itl_target_ms,
        model=model,
        source_id=source,
        since=since,
        until=until,
        depth=depth,
        arrival_share=arrival_share,
        max_steps=max_steps,
        min_chunk=min_chunk,
    )

    def compute(engine: Any) -> ChunkSizeAdvice:
        from ledger.advice.service import chunk_size_advice

        return chunk_size_advice(engine, query)

    answer(
        fmt=format,
        db=db,
        ledger=ledger,
        token=token,
        path="/v1/advice/chunk-size",
        query=query,
        record=ChunkSizeAdvice,
        compute=compute,
        render=render_advice,
        render_refusal=render_refusal,
    )


def _advice_query(**options: Any) -> AdviceQuery:
    """The question as the API parses it; exit 2 naming the option when a value is out of its bounds."""
    try:
        return AdviceQuery.parse(**options)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


def _int_list(text: str, option: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        typer.echo(f"error: {option} must be comma-separated integers, got {text!r}", err=True)
        raise typer.Exit(2) from None
    return values


def _checked_plan(chunk_sizes: str, max_depth: int, decode_batches: str, repeats: int) -> ProfilePlan:
    """The profile's plan from its options; exit 2 naming what is wrong."""
    from ledger.advice.profile import ProfileError, ProfilePlan

    plan = ProfilePlan(
        chunk_sizes=_int_list(chunk_sizes, "--chunk-sizes"),
        max_depth=max_depth,
        decode_batches=_int_list(decode_batches, "--decode-batches"),
        repeats=repeats,
    )
    try:
        plan.check()
    except ProfileError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    return plan


def _tiny_model(directory: str, max_model_len: int, hidden: int, layers: int) -> str:
    """``--tiny``: a random-weight Llama built in ``directory``, vLLM's caches beside it."""
    import os

    from engine_hooks.vllm.tiny_model import build_tiny_model, vllm_env

    try:
        model = build_tiny_model(directory, hidden=hidden, layers=layers, max_pos=max(max_model_len, 128))
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    os.environ.update(vllm_env(os.path.join(model, ".vllm")))
    return model


def _quiet_vllm() -> None:
    """vLLM logs to stdout at INFO by default: keep stdout for the report (--format json is parsed)."""
    import logging
    import os

    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    logging.getLogger("httpx").setLevel(logging.WARNING)


def _print_phase(phase: Phase) -> None:
    """Progress of ``chunkledger profile`` (on stderr: stdout is the report)."""
    typer.echo(
        f"  chunk {phase.chunk:>5} next to {phase.decodes:>3} decodes: "
        f"{phase.end_step - phase.first_step} steps in {phase.wall_s:.1f} s",
        err=True,
    )


def profile(
    model: Annotated[str, typer.Argument(help="model directory or name vLLM can load (offline)")],
    chunk_sizes: Annotated[
        str, typer.Option(help="prefill chunk sizes to measure (tokens)")
    ] = "256,512,1024,2048",
    max_depth: Annotated[
        int, typer.Option(help="deepest chunk start measured (tokens into the prompt)")
    ] = 8192,
    decode_batches: Annotated[
        str, typer.Option(help="decode batch sizes running next to the chunks")
    ] = "1,8,32",
    repeats: Annotated[int, typer.Option(min=1, help="runs of the whole plan")] = 1,
    itl_target_ms: Annotated[
        float | None, typer.Option("--itl-target-ms", min=0.001, help="also advise for this ITL target")
    ] = None,
    tiny: Annotated[
        bool, typer.Option(help="first build a tiny random-weight Llama in MODEL (a directory; no download)")
    ] = False,
    tiny_hidden: Annotated[int, typer.Option(help="--tiny: hidden size")] = 128,
    tiny_layers: Annotated[int, typer.Option(help="--tiny: decoder layers")] = 2,
    ledger: Annotated[
        str | None,
        typer.Option(
            help="also send the steps to this ledger (as production does); default: in process only"
        ),
    ] = None,
    source_id: Annotated[
        str | None, typer.Option(help="source id at the ledger (default profile-<model>)")
    ] = None,
    ingest_token: Annotated[
        str | None,
        typer.Option(help="ingest token (env CHUNKLEDGER_INGEST_TOKEN)", envvar="CHUNKLEDGER_INGEST_TOKEN"),
    ] = None,
    kv_cache_mib: Annotated[
        int, typer.Option(min=16, help="KV cache size for the profile engine (MiB)")
    ] = 512,
    format: FormatOpt = "table",
) -> None:
    """Measure step time on vLLM with chunkledger's plugin: chunk sizes x depths x decode batches.

    Prints the measured table (per chunk size: ms at depth 0 and per 1k tokens of depth; decode-only
    steps per batch) and the fit `chunkledger advise` would make from it, before production traffic.
    """
    from engine_hooks.vllm.profile import DriverError, run_profile
    from ledger.advice.profile import ProfileError, ProfileResult
    from ledger.advice.report import render_profile
    from ledger.records import UNSET, as_json

    if format not in ("table", "json"):
        typer.echo("error: --format must be table or json", err=True)
        raise typer.Exit(2)
    plan = _checked_plan(chunk_sizes, max_depth, decode_batches, repeats)
    if tiny:
        model = _tiny_model(model, plan.max_model_len, tiny_hidden, tiny_layers)
    _quiet_vllm()
    try:
        run = run_profile(
            model,
            plan,
            ledger_url=ledger,
            source_id=source_id,
            ingest_token=ingest_token,
            kv_cache_bytes=kv_cache_mib << 20,
            progress=_print_phase if format == "table" else None,
        )
    except (ProfileError, DriverError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    report = ProfileResult.of(plan, run).report(itl_target_ms)
    typer.echo(json.dumps(as_json(report), indent=2) if format == "json" else render_profile(report))
    if report.fit_error is not UNSET:
        raise typer.Exit(1)
