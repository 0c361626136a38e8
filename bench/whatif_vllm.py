"""The what-if model (:mod:`ledger.whatif`) against real vLLM: record one configuration, predict the others.

1. Runs :mod:`bench.head_of_line` (real vLLM on this CPU, the plugin reporting to a real ledger) on one
   scene (fixed ``--seed``, ``--long-tokens``, ``--gap-ms``, ``--duration``: every configuration sees
   the same requests) for ``--configs`` (default: unchunked, chunk-256, chunk-512, chunk-2048,
   chunk-2048-thr256, reserve), keeping the ledger's DuckDB file (``--ledger-db``), with each request's
   scene arrival as vLLM's ``arrival_time`` (``--stamp-arrival``: the ledger's engine arrival is then
   when the client sent it, as an API server would stamp it). Its own table (client-side figures, the
   load average after each configuration) is printed as it ends.
2. Reads the database read-only. Each configuration's window is its engine's source (``<tag>-<name>``)
   from the scene's start (after the warmup) to its last step. The settings are those vLLM ran (the
   worker reads them off the scheduler: budget, threshold, chunked prefill, ``max_num_seqs``, the KV
   blocks it allocated and their size, ``scheduler_reserve_full_isl``), plus the plugin's
   ``admission_reserve`` for the reserve configuration.
3. :func:`ledger.whatif.service.what_if` on the ``--recorded`` configuration's window (its step-time
   fit, its requests) with every other configuration as a candidate: the predictions. The measured
   tails of each configuration are the ledger's engine-side view of its own window
   (:func:`ledger.whatif.trace.read_recorded`, what a calibration compares with): short-request TTFT
   p99 and the long prompt's TTFT, from the engine arrival to the first token, and the decode ITL p99
   (step intervals, one sample per decoding request). The recorded configuration's row is the
   calibration (its setting replayed against its own tails).
4. Prints predicted vs measured per configuration with the relative errors (``ok`` within
   ``--tolerance``, 15 %), and the best configuration predicted and measured: the lowest short TTFT p99
   among those whose ITL p99 meets ``--itl-target-ms`` (50 ms), and of all. Then
   :mod:`bench.whatif_diagnose` (where the errors come from) and :mod:`bench.whatif_variants` (the
   errors under changed step costs). Exits 0 whatever the errors: it reports.

With ``--attention-profile`` or ``--fit-profile``: after each scene, ``chunkledger profile`` runs the
same tiny model on this CPU
(chunk sizes 256 to 16,384 at depths to 32,768, next to 1, 4 and 8 decodes) and sends its steps to the
run's ledger as source ``profile-scene``. ``--attention-profile`` takes from it the attention inside
a chunk, which the recorded window's one chunk size cannot show, and the rest of the step time from the
window (``what_if(attention_source=...)``); ``--fit-profile`` takes the whole step time from it
(``what_if(fit_source=...)``).

``self`` in the table: each configuration replayed under its own setting with its own window's fit
(its calibration), which separates the model's error from the transfer's (``-`` when its window cannot
be fitted, e.g. unchunked: no chunk at any depth).

    .venv/bin/python -m bench.whatif_vllm --json /tmp/whatif_vllm.json          # about 6 minutes
    .venv/bin/python -m bench.whatif_vllm --reuse /tmp/chunkledger-whatif-XXXX   # that run's files again
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import sqlalchemy as sa

from bench.head_of_line import CONFIGS as HOL_CONFIGS
from bench.toolkit import free_port
from bench.whatif_compare import TAILS, TOLERANCE, aggregate, best, render

if TYPE_CHECKING:
    from ledger.whatif.answer import WhatIf

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIGS = ("unchunked", "chunk-256", "chunk-512", "chunk-2048", "chunk-2048-thr256", "reserve")
SETTING_KEYS = (  # EngineSettings fields as vLLM ran them (head_of_line's worker reads them)
    "max_num_batched_tokens",
    "long_prefill_token_threshold",
    "enable_chunked_prefill",
    "max_num_seqs",
    "num_kv_blocks",
    "block_size",
    "reserve_full_isl",
)
MODELLED_PLUGIN = ("admission_reserve", "admission_aging_s")  # the plugin options the model knows
HOL_JSON, LEDGER_DB, PROFILE_JSON = "hol.json", "ledger.duckdb", "profile.json"
PROFILE_SOURCE = "profile-scene"
SERVE = (sys.executable, "-m", "chunkledger", "serve", "--db")
PROFILE_PLAN: tuple[str, ...] = ("--chunk-sizes", "256,1024,4096,8192,16384", "--max-depth", "32768")
PROFILE_PLAN += ("--decode-batches", "1,4,8")


# -- what the model is given (tests/bench/test_whatif_vllm.py) ----------------------------------------


def settings_of(name: str, engine: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`engine_hooks.scheduling.settings.EngineSettings` values of configuration ``name`` as
    vLLM ran it (``engine``: head_of_line's ``engine`` figures), plus the plugin's options the model
    knows."""
    values = {k: engine[k] for k in SETTING_KEYS}
    plugin = HOL_CONFIGS[name].get("plugin", {})
    values.update({k: plugin[k] for k in MODELLED_PLUGIN if k in plugin})
    return values


def unmodelled(name: str, engine: Mapping[str, Any]) -> list[str]:
    """What configuration ``name`` sets that the model does not know (its prediction ignores it)."""
    out = [k for k in HOL_CONFIGS[name].get("plugin", {}) if k not in MODELLED_PLUGIN]
    if engine.get("adaptive_threshold"):
        out.append("long_prefill_token_threshold_adaptive")
    return out


# -- running the scene ---------------------------------------------------------------------------------


def run_scene(args: argparse.Namespace, work: Path) -> None:
    """bench.head_of_line on the configurations, keeping its results and ledger database in ``work``."""
    cmd = [sys.executable, "-m", "bench.head_of_line", "--only", ",".join(args.configs)]
    cmd += ["--long-tokens", str(args.long_tokens), "--gap-ms", args.gap_ms, "--duration", str(args.duration)]
    cmd += [
        "--long-at",
        str(args.long_at),
        "--seed",
        str(args.seed),
        "--short-output",
        str(args.short_output),
    ]
    cmd += ["--ledger-db", str(work / LEDGER_DB), "--json", str(work / HOL_JSON), "--stamp-arrival"]
    print("$ " + " ".join(cmd[1:]), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, timeout=3600)
    if proc.returncode or not (work / HOL_JSON).exists():
        raise SystemExit(f"head_of_line failed (exit {proc.returncode}); its files are in {work}")


def run_profile_into(work: Path, hidden: int, layers: int) -> None:
    """``chunkledger profile`` on the scene's model size, its steps sent to ``work``'s ledger database
    as ``PROFILE_SOURCE`` (a ledger is started on it for that), its report kept in ``PROFILE_JSON``."""
    import time

    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(work / "profile-ledger.log", "wb") as log:
        server = subprocess.Popen(
            [*SERVE, f"duckdb:///{work / LEDGER_DB}", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            for _ in range(600):
                try:
                    if httpx.get(f"{url}/readyz", timeout=1.0).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if server.poll() is not None:
                    raise SystemExit(f"the ledger did not start; see {work / 'profile-ledger.log'}")
                time.sleep(0.2)
            cmd = [sys.executable, "-m", "chunkledger", "profile", str(work / "profile-model"), "--tiny"]
            cmd += ["--tiny-hidden", str(hidden), "--tiny-layers", str(layers), *PROFILE_PLAN]
            cmd += ["--ledger", url, "--source-id", PROFILE_SOURCE, "--format", "json"]
            print("$ " + " ".join(cmd[3:]), flush=True)
            with open(work / "profile.log", "w") as err:
                proc = subprocess.run(
                    cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, timeout=1800
                )
            if proc.returncode:
                raise SystemExit(f"profile failed (exit {proc.returncode}); see {work / 'profile.log'}")
            (work / PROFILE_JSON).write_text(proc.stdout)
        finally:
            server.terminate()  # a clean stop: what the writer holds is committed first
            server.wait(60)


# -- reading the ledger ------------------------------------------------------------------------------


def window_of(engine: sa.Engine, result: Mapping[str, Any]) -> tuple[float, float]:
    """[since, until) of a configuration's run: its scene's start to just after its last step."""
    with engine.connect() as conn:
        last = conn.execute(
            sa.text("SELECT max(ts) FROM steps WHERE source_id = :s"), {"s": result["source_id"]}
        ).scalar()
    since = float(result["scene_ts"])
    return since, (float(last) if last is not None else since) + 1.0


def measured_of(engine: sa.Engine, result: Mapping[str, Any], cut: int) -> dict[str, Any]:
    """The ledger's tails of one configuration's window (what a calibration compares with)."""
    from ledger.whatif.query import WhatIfQuery
    from ledger.whatif.service import load_window

    since, until = window_of(engine, result)
    query = WhatIfQuery(source_id=result["source_id"], since=repr(since), until=repr(until))
    return _builtins(load_window(engine, query).recorded.summary(cut))


def what_if_on(
    engine: sa.Engine,
    result: Mapping[str, Any],
    candidates: Sequence[Mapping[str, Any]],
    cut: int,
    itl_target_ms: float | None,
    fit_source: str | None = None,
    step_noise: bool = True,
    attention_source: str | None = None,
) -> WhatIf:
    """:func:`ledger.whatif.service.what_if` on one configuration's window, forced past a failed
    calibration (this bench reports the error instead); ``fit_source``: the steps the step time is
    fitted on (default: the window's own); no ``candidates``: the calibration alone."""
    from ledger.whatif.query import WhatIfQuery, setting_text
    from ledger.whatif.service import what_if

    since, until = window_of(engine, result)
    query = WhatIfQuery(
        recorded=setting_text(settings_of(result["config"], result["engine"])),
        source_id=result["source_id"],
        since=repr(since),
        until=repr(until),
        long_prompt_tokens=cut,
        itl_target_ms=itl_target_ms,
        force=True,
        fit_source=fit_source,
        step_noise=step_noise,
        attention_source=attention_source,
    )
    return what_if(engine, query, candidates=candidates)


def self_replay(
    engine: sa.Engine, result: Mapping[str, Any], cut: int, step_noise: bool = True
) -> dict[str, Any] | None:
    """A configuration's own calibration (its setting, its window's fit); None when it has none."""
    from ledger.whatif.answer import WhatIfError

    try:
        answer = what_if_on(engine, result, [], cut, None, step_noise=step_noise)
        return _builtins(answer.calibration.predicted)
    except WhatIfError as exc:
        return {"refused": exc.reason}


def _builtins(record: Any) -> dict[str, Any]:
    out = msgspec.to_builtins(record)
    assert isinstance(out, dict)
    return out


def evaluate(engine: sa.Engine, results: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """One run: the predictions from the recorded configuration's window, every configuration's own
    measured tails and its own calibration (:func:`bench.whatif_compare.aggregate` compares them)."""
    by = {r["config"]: r for r in results}
    if args.recorded not in by:
        raise SystemExit(f"--recorded {args.recorded}: it did not run (ran: {', '.join(by)})")
    others = [r for r in results if r["config"] != args.recorded]
    target_ms = args.itl_target_ms or None
    answer = what_if_on(
        engine,
        by[args.recorded],
        [settings_of(r["config"], r["engine"]) for r in others],
        args.long_prompt_tokens,
        target_ms,
        PROFILE_SOURCE if args.fit_profile else None,
        args.step_noise,
        PROFILE_SOURCE if args.attention_profile else None,
    )
    predicted = {args.recorded: _builtins(answer.calibration.predicted)}
    predicted.update(
        {r["config"]: _builtins(row.predicted) for r, row in zip(others, answer.candidates, strict=True)}
    )
    rows = []
    for r in results:
        name = r["config"]
        rows.append(
            {
                "config": name,
                "recorded": name == args.recorded,
                "settings": settings_of(name, r["engine"]),
                "unmodelled": unmodelled(name, r["engine"]),
                "self": self_replay(engine, r, args.long_prompt_tokens, args.step_noise),
                "measured_all": measured_of(engine, r, args.long_prompt_tokens),
                "predicted_all": predicted[name],
            }
        )
    return {
        "recorded": args.recorded,
        "long_prompt_tokens": args.long_prompt_tokens,
        "itl_target_ms": target_ms,
        "fit": _builtins(answer.fit),
        "calibration_error": _builtins(answer.calibration.error),
        "rows": rows,
    }


def variants_of(engine: sa.Engine, results: list[dict[str, Any]], ev: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`bench.whatif_variants.predict_variants` from the recorded window, every configuration."""
    from bench.whatif_variants import predict_variants

    rec = next(r for r in results if r["config"] == ev["recorded"])
    candidates = {r["config"]: settings_of(r["config"], r["engine"]) for r in results}
    return predict_variants(
        engine,
        rec["source_id"],
        window_of(engine, rec),
        candidates[ev["recorded"]],
        candidates,
        ev["long_prompt_tokens"],
    )


def render_variant_table(variants: Mapping[str, Any], ev: Mapping[str, Any]) -> list[str]:
    from bench.whatif_variants import render_variants

    measured = {row["config"]: row["measured_all"] for row in ev["rows"]}
    target = ev["itl_target_ms"] / 1e3 if ev["itl_target_ms"] else None
    picks = {v: best(body["predicted"], target) for v, body in variants.items()}
    picks["measured"] = best(measured, target)
    return render_variants(variants, measured, TAILS, ev["tolerance"], picks, ev["recorded"])


def _load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def run_dirs(args: argparse.Namespace) -> list[Path]:
    """The runs' folders: ``--reuse``'s (itself, or its ``run-N`` folders), else ``--repeat`` new ones,
    each after running the scene into it."""
    if args.reuse:
        work = Path(args.reuse)
        if (work / HOL_JSON).exists():
            return [work]
        return sorted(work.glob("run-*"), key=lambda d: int(d.name.removeprefix("run-")))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="chunkledger-whatif-"))
    dirs = [work / f"run-{k + 1}" for k in range(args.repeat)]
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        run_scene(args, d)
    return dirs


def profile_dirs(args: argparse.Namespace, dirs: list[Path]) -> None:
    """``--fit-profile``: a profile into each run's ledger that has none yet."""
    for d in dirs:
        if not (d / PROFILE_JSON).exists():
            hol = json.loads((d / HOL_JSON).read_text())
            scene = hol["scene"]
            run_profile_into(d, int(scene.get("hidden", 128)), int(scene.get("layers", 2)))


def analyse(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One run's evaluation, diagnosis and variants, from its results and its ledger database."""
    from bench.whatif_diagnose import diagnose

    hol = json.loads((work / HOL_JSON).read_text())
    results = [r for r in hol["results"] if r["config"] in args.configs]
    engine = sa.create_engine(f"duckdb:///{work / LEDGER_DB}", connect_args={"read_only": True})
    try:
        ev = evaluate(engine, results, args)
        diag = diagnose(engine, results, ev, window_of)
        variants = variants_of(engine, results, ev)
    finally:
        engine.dispose()
    loads = {r["config"]: r.get("load") for r in results}
    return {
        "work": str(work),
        "scene": hol["scene"],
        "load": loads,
        "evaluation": ev,
        "diagnosis": diag,
        "variants": variants,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help="head_of_line configurations")
    ap.add_argument(
        "--recorded", default="chunk-2048", help="the configuration whose window predicts the rest"
    )
    ap.add_argument("--long-tokens", type=int, default=16000)
    ap.add_argument("--gap-ms", default="25,75", help="min,max gap between short arrivals (ms)")
    ap.add_argument("--duration", type=float, default=8.0, help="short arrivals for this long (s)")
    ap.add_argument("--long-at", type=float, default=2.0)
    ap.add_argument("--short-output", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--long-prompt-tokens", type=int, default=1024, help="prompts this long are the long ones"
    )
    ap.add_argument("--itl-target-ms", type=float, default=50.0, help="the best must meet it (0: none)")
    ap.add_argument("--tolerance", type=float, default=TOLERANCE)
    ap.add_argument("--repeat", type=int, default=1, help="run the scene this many times: medians")
    ap.add_argument("--workdir", default="", help="keep the runs here (default: a new temporary folder)")
    ap.add_argument("--reuse", default="", help="the folder of earlier runs: no vLLM, read their files")
    ap.add_argument("--json", default="", help="also write the comparison here")
    ap.add_argument(
        "--no-step-noise",
        dest="step_noise",
        action="store_false",
        help="replay the fitted step times alone (no factor from the window's spread)",
    )
    ap.add_argument(
        "--attention-profile",
        action="store_true",
        help="take the attention inside a chunk from a chunkledger profile run (made after each scene), the "
        "rest of the step time from the window",
    )
    ap.add_argument(
        "--fit-profile",
        action="store_true",
        help="fit the step time on a chunkledger profile run (made after each scene) instead of the window",
    )
    args = ap.parse_args()
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in HOL_CONFIGS]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}")
    print(f"load average (1, 5, 15 min) at the start, on {os.cpu_count()} cores: {_load()}", flush=True)
    dirs = run_dirs(args)
    if args.fit_profile or args.attention_profile:
        profile_dirs(args, dirs)
    runs = [analyse(args, d) for d in dirs]
    if not runs:
        raise SystemExit(f"--reuse {args.reuse}: no run there")
    target_s = args.itl_target_ms / 1e3 if args.itl_target_ms else None
    ev = aggregate([r["evaluation"] for r in runs], args.tolerance, target_s)
    from bench.whatif_diagnose import render_diagnosis
    from bench.whatif_variants import aggregate_variants

    variants = aggregate_variants([r["variants"] for r in runs])
    scene = runs[0]["scene"]
    print(
        f"\nwhat-if vs real vLLM: {scene['long_tokens']}-token prompt at {args.long_at:g} s among shorts "
        f"every {args.gap_ms} ms for {args.duration:g} s, seed {scene['seed']}; recorded: {args.recorded}; "
        f"{len(runs)} run(s) kept in {Path(runs[0]['work']).parent if len(runs) > 1 else runs[0]['work']}"
    )
    for line in render(ev):
        print(line)
    for k, run in enumerate(runs):
        print(f"\nrun {k + 1} ({run['work']}): ", end="")
        for line in render_diagnosis(run["diagnosis"]):
            print(line)
    print()
    for line in render_variant_table(variants, ev):
        print(line)
    for k, run in enumerate(runs):
        loads = ", ".join(f"{c} {v:.1f}" for c, v in run["load"].items() if v is not None)
        print(f"  run {k + 1}: load average (1 min) after each configuration: {loads}")
    print(f"  load average now: {_load()}")
    if args.json:
        out = {"scene": scene, "evaluation": ev, "variants": variants, "runs": runs}
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
