"""``chunkledger loopcheck`` and ``chunkledger policy-check``: the rules offline.

The rules and the policy model load when a command runs, not when the command line starts.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from ledger.rules.loop import LoopHit
    from ledger.rules.policy import Policy, RuleSettings


def _live_policy(policy_file: str | None, ledger: str | None, token: str | None) -> Policy:
    """The policy to use: from the running ledger, else the policy file, else the defaults."""
    from ledger.client import LedgerClient, LedgerError
    from ledger.rules.policy import Policy, PolicyError, load_policy_file, parse_policy

    if ledger:
        try:
            with LedgerClient(ledger, token, token_env="CHUNKLEDGER_ADMIN_TOKEN", timeout_s=10) as client:
                answer = client.get("/v1/policy")
        except LedgerError as exc:
            if exc.unreachable:
                raise PolicyError(str(exc)) from None
            raise PolicyError(
                f"GET {ledger}/v1/policy answered {exc.status_code}: {exc.detail[:200]}"
            ) from None
        return parse_policy(answer["policy"])
    if policy_file:
        return load_policy_file(policy_file)
    return Policy()


def loopcheck(
    file: Annotated[str, typer.Argument(help='JSON lines {"id": ..., "tokens": [int, ...]}; "-" for stdin')],
    model: Annotated[
        str | None, typer.Option(help="use this model's loop settings (per-model overrides)")
    ] = None,
    policy: Annotated[
        str | None,
        typer.Option(help="policy file (env CHUNKLEDGER_POLICY_FILE); default: the built-in defaults"),
    ] = None,
    ledger: Annotated[
        str | None, typer.Option(help="read the live policy from this ledger's GET /v1/policy instead")
    ] = None,
    token: Annotated[
        str | None, typer.Option(help="admin token for --ledger", envvar="CHUNKLEDGER_ADMIN_TOKEN")
    ] = None,
) -> None:
    """Run the live loop rules over past outputs (audit what they would have cut).

    Prints one JSON line per input line: {"id", "loop", "rule": "loop", "near_loop" or
    "paraphrase_loop" (or null), "at": index of the token where it would have cut (or null), "period",
    "repeats", "span" (or null; a paraphrase loop has no period: its span is the window looked at)}.
    Each rule runs only where the policy enables it (paraphrase_loop is off by default). Bad lines are
    reported on stderr (line number and reason) and the exit status is then 1.
    """
    import os

    from ledger.rules.policy import PolicyError

    policy = policy or os.environ.get("CHUNKLEDGER_POLICY_FILE") or None
    try:
        rules = _live_policy(policy, ledger, token).rules_for(model)
    except PolicyError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        stream: Any = sys.stdin if file == "-" else open(file)  # noqa: SIM115 - closed below
    except OSError as exc:
        typer.echo(f"error: {file}: {exc.strerror}", err=True)
        raise typer.Exit(2) from None
    bad = 0
    out = sys.stdout
    with stream:
        for lineno, line in enumerate(stream, 1):
            if not line.strip():
                continue
            try:
                output_id, tokens = _output(line)
            except ValueError as exc:
                typer.echo(f"{file}:{lineno}: {exc}", err=True)
                bad += 1
                continue
            hit, rule = _first_cut(rules, tokens)
            out.write(
                json.dumps(
                    {
                        "id": output_id,
                        "loop": hit is not None,
                        "rule": rule,
                        "at": hit.at if hit else None,
                        "period": hit.period if hit and hit.period else None,
                        "repeats": hit.repeats if hit and hit.period else None,
                        "span": hit.span if hit else None,
                    }
                )
                + "\n"
            )
    if bad:
        raise typer.Exit(1)


def _output(line: str) -> tuple[Any, list[int]]:
    """One input line's id and tokens; ValueError naming what is wrong."""
    item = json.loads(line)
    if not isinstance(item, dict):
        raise ValueError("expected an object")
    if "id" not in item:
        raise ValueError("field id: missing")
    tokens = item.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise ValueError("field tokens: must be a list of integers")
    return item["id"], tokens


def _first_cut(rules: RuleSettings, tokens: list[int]) -> tuple[LoopHit | None, str | None]:
    """Where the live loop rules (``rules``: one model's) would first cut ``tokens``, and which rule
    (a paraphrase loop's hit as a LoopHit with no period: ``period`` and ``repeats`` 0, its window as
    the span)."""
    from ledger.rules.loop import LoopHit, exact_detector, near_detector
    from ledger.rules.paraphrase import paraphrase_detector

    found: list[tuple[LoopHit, str]] = []
    if rules.loop.enabled and (h := exact_detector(rules.loop).extend(tokens)) is not None:
        found.append((h, "loop"))
    if rules.near_loop.enabled and (h := near_detector(rules.near_loop).extend(tokens)):
        found.append((h, "near_loop"))
    if rules.paraphrase_loop.enabled and (ph := paraphrase_detector(rules.paraphrase_loop).extend(tokens)):
        found.append((LoopHit(at=ph.at, period=0, repeats=0, span=ph.window), "paraphrase_loop"))
    if not found:
        return None, None
    return min(found, key=lambda x: x[0].at)


def policy_check(file: Annotated[str, typer.Argument(help="policy file (.toml, .yaml or .json)")]) -> None:
    """Validate a policy file; print the effective policy as JSON (exit 2 naming the bad field)."""
    from ledger.rules.policy import PolicyError, load_policy_file

    try:
        p = load_policy_file(file)
    except PolicyError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps(p.model_dump(mode="json"), indent=2))


def register(app: typer.Typer) -> None:
    app.command(name="loopcheck")(loopcheck)
    app.command(name="policy-check")(policy_check)
