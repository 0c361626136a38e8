"""``chunkledger whatif`` (registered by ``chunkledger.main``)."""

from __future__ import annotations

from typing import Annotated, Any

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
from ledger.whatif.answer import WhatIf
from ledger.whatif.query import MAX_CALIBRATION_ERROR, WhatIfQuery
from ledger.whatif.report import render_refusal, render_whatif

# the options, in the order --help shows them
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        help="a setting to replay, key=value[,key=value] (repeat for several): max_num_batched_tokens, "
        "long_prefill_token_threshold, max_num_seqs, num_kv_blocks, block_size, enable_chunked_prefill, "
        "admission_reserve, admission_aging_s, policy, reserve_full_isl",
    ),
]
SweepOpt = Annotated[
    str | None,
    typer.Option(help="one setting per value: key=v1,v2,... (max_num_batched_tokens=256,512)"),
]
PolicyOpt = Annotated[
    str | None, typer.Option(help="fcfs, priority or kv-idle: applied to every asked setting")
]
RecordedOpt = Annotated[
    str | None,
    typer.Option(help="the engine's settings in the window, key=value[,...] (the rest are inferred)"),
]
LongPromptTokensOpt = Annotated[
    int | None, typer.Option(min=1, help="prompts this long are the long ones (default: 8x the median)")
]
ItlTargetMsOpt = Annotated[
    float | None, typer.Option("--itl-target-ms", min=0.001, help="mark settings meeting this ITL p99")
]
TtftTargetMsOpt = Annotated[
    float | None,
    typer.Option("--ttft-target-ms", min=0.001, help="mark settings meeting this TTFT p99"),
]
MaxErrorOpt = Annotated[
    float, typer.Option(min=0.0, help="refuse when the recorded setting replayed misses a tail by more")
]
ForceOpt = Annotated[bool, typer.Option(help="answer even over --max-error")]
FitSourceOpt = Annotated[
    str | None, typer.Option(help="fit step time on this engine's steps (e.g. a chunkledger profile run)")
]
FitSinceOpt = Annotated[str | None, typer.Option(help="fit step time on steps from then (same forms)")]
FitUntilOpt = Annotated[str | None, typer.Option(help="... until then")]
AttentionSourceOpt = Annotated[
    str | None,
    typer.Option(
        help="fit the attention inside a chunk on this engine's steps (a chunkledger profile run), "
        "the rest on the window's"
    ),
]
StepNoiseOpt = Annotated[
    bool,
    typer.Option(
        help="each replayed decode-only step's time times a factor drawn from the window's own "
        "steps' spread, plus the engine loop's time between steps as the window measured it"
    ),
]


def whatif(
    set_: SetOpt = None,
    sweep: SweepOpt = None,
    policy: PolicyOpt = None,
    recorded: RecordedOpt = None,
    ledger: LedgerOrNoneOpt = None,
    db: DbOpt = None,
    model: ModelOpt = None,
    source: SourceOpt = None,
    since: SinceOpt = None,
    until: UntilOpt = None,
    long_prompt_tokens: LongPromptTokensOpt = None,
    itl_target_ms: ItlTargetMsOpt = None,
    ttft_target_ms: TtftTargetMsOpt = None,
    max_error: MaxErrorOpt = MAX_CALIBRATION_ERROR,
    force: ForceOpt = False,
    fit_source: FitSourceOpt = None,
    fit_since: FitSinceOpt = None,
    fit_until: FitUntilOpt = None,
    attention_source: AttentionSourceOpt = None,
    step_noise: StepNoiseOpt = True,
    token: ReadTokenOpt = None,
    format: FormatOpt = "table",
) -> None:
    """Replay the window's recorded requests under other settings and predict the tails.

    The recorded requests (arrival, prompt, prefix hit, output length) go through a model of vLLM v1's
    scheduler, with step durations from the step-time fit of the same window. The recorded setting is
    replayed first: its error against the measured tails is printed beside every prediction, and the
    answer is refused when it is over --max-error. Exit status 1 when there is no answer.
    """
    query = WhatIfQuery(
        set=set_ or [],
        sweep=sweep,
        policy=policy,
        recorded=recorded,
        model=model,
        source_id=source,
        since=since,
        until=until,
        long_prompt_tokens=long_prompt_tokens,
        itl_target_ms=itl_target_ms,
        ttft_target_ms=ttft_target_ms,
        max_error=max_error,
        force=force,
        fit_source=fit_source,
        fit_since=fit_since,
        fit_until=fit_until,
        attention_source=attention_source,
        step_noise=step_noise,
    )

    def compute(engine: Any) -> WhatIf:
        from ledger.whatif.service import what_if

        return what_if(engine, query)

    answer(
        fmt=format,
        db=db,
        ledger=ledger,
        token=token,
        path="/v1/whatif",
        query=query,
        record=WhatIf,
        compute=compute,
        render=render_whatif,
        render_refusal=render_refusal,
    )
