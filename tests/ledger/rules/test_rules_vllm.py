"""Real vLLM (CPU, tiny random-weight model) against the real ledger: a request with no stop is cut.

The engine runs in this process with the chunkledger scheduler plugin; its exporter posts to a real
``chunkledger serve`` whose policy caps output at 48 tokens. The request asks for 2000 tokens with EOS
ignored (no stop). The cap decision rides back on an ingest response, the plugin aborts the request on
its next schedule, and the client's output finishes with ``abort`` and ``chunkledger:token_cap``.
"""

from __future__ import annotations

import os
import time
import uuid

import pytest
import sqlalchemy as sa

pytestmark = pytest.mark.vllm

vllm = pytest.importorskip("vllm")

from engine_hooks.config import ExporterConfig  # noqa: E402
from engine_hooks.exporter import Exporter  # noqa: E402
from engine_hooks.vllm.cpu import engine_settings  # noqa: E402
from engine_hooks.vllm.tiny_model import build_tiny_model, vllm_env  # noqa: E402
from tests.support.servers import LedgerServer  # noqa: E402

CAP = 48
FLUSH_S = 0.02
STEP_PACE_S = 0.01  # a floor on step time, so that the run looks like a served model, not a tight loop


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm-rules")
    saved = {k: os.environ.get(k) for k in ("CHUNKLEDGER_URL", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    os.environ.update(vllm_env(d / "env"))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.pop("CHUNKLEDGER_URL", None)
    settings = engine_settings()
    settings.apply_threads()
    from vllm import LLM

    llm = LLM(
        build_tiny_model(d / "tiny-llama"),
        **settings.llm_kwargs(),
        enforce_eager=True,
        kv_cache_memory_bytes=4096 * settings.kv_bytes_per_token(2, 128),
        max_num_batched_tokens=128,
        enable_chunked_prefill=True,
        max_model_len=2560,
        max_num_seqs=8,
        scheduler_cls="engine_hooks.vllm.LedgerScheduler",
    )
    yield llm
    del llm
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def test_request_without_a_stop_is_cut_by_the_token_cap_and_the_client_sees_the_reason(llm, tmp_path):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from engine_hooks.vllm.scheduler import XARGS_KEY, iter_schedulers

    policy = tmp_path / "policy.toml"
    policy.write_text(f"[rules]\nmax_output_tokens = {CAP}\n")
    server = LedgerServer(
        f"duckdb:///{tmp_path / 'ledger.duckdb'}",
        tmp_path / "ledger.log",
        env={"CHUNKLEDGER_POLICY_FILE": str(policy)},
    )
    server.start()
    scheduler = next(iter(iter_schedulers(llm)))
    exporter = Exporter(
        ExporterConfig.create(
            url=server.url,
            source_id=f"vllm-rules-{uuid.uuid4().hex[:6]}",
            spool_dir=str(tmp_path / "spool"),
            spool_fsync=False,
            flush_interval_s=FLUSH_S,
        ),
        on_command=scheduler.submit_command,
    )
    scheduler.use_exporter(exporter)
    core = llm.llm_engine
    rid = f"runaway-{uuid.uuid4().hex[:8]}"
    try:
        sp = SamplingParams(max_tokens=2000, ignore_eos=True, temperature=0.0, extra_args={XARGS_KEY: rid})
        core.add_request(rid, TokensPrompt(prompt_token_ids=list(range(10, 74))), sp)
        final, steps, step_s = None, 0, []
        while core.has_unfinished_requests() and steps < 3000:
            t0 = time.monotonic()
            for out in core.step():
                if out.finished:
                    final = out
            step_s.append(time.monotonic() - t0)
            time.sleep(max(0.0, STEP_PACE_S - step_s[-1]))
            steps += 1
        assert final is not None, "the request never finished"
        assert exporter.force_flush(10)
    finally:
        scheduler.use_exporter(None)
        exporter.shutdown(5.0)
        server.stop()
    out = final.outputs[0]
    assert out.finish_reason == "abort" and out.stop_reason == "chunkledger:token_cap"
    produced = len(out.token_ids)
    assert CAP < produced < 2000
    eng = sa.create_engine(server.db_url)
    with eng.connect() as conn:
        row = conn.execute(sa.text("SELECT * FROM cutoffs WHERE request_id = :r"), {"r": rid}).one()._mapping
        req = conn.execute(sa.text("SELECT * FROM requests WHERE request_id = :r"), {"r": rid}).one()._mapping
    eng.dispose()
    assert row["rule"] == "token_cap" and row["state"] == "applied" and row["applied_ts"] is not None
    assert req["finish_reason"] in ("cutoff", "abort") and req["stop_reason"] == "chunkledger:token_cap"
    # Decided on the batch that crossed the cap; applied on the engine's next schedule after the
    # response came back: within one flush interval plus one step, plus the HTTP round trip.
    step_p99 = sorted(step_s)[int(0.99 * (len(step_s) - 1))] + STEP_PACE_S
    took = row["applied_ts"] - row["decided_ts"]
    print(
        f"cut after {produced} tokens; decision -> applied {took * 1000:.0f} ms; "
        f"step p99 {step_p99 * 1000:.0f} ms"
    )
    assert took < FLUSH_S + step_p99 + 0.5, took
    assert produced <= CAP + 16 + int((FLUSH_S + 0.5) / STEP_PACE_S) + 2
