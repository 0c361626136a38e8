"""AsyncLedgerScheduler (vLLM's async scheduling, the default on GPU) in its own engine process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine_hooks.vllm.cpu import engine_settings
from engine_hooks.vllm.tiny_model import vllm_env
from tests.support import ROOT

pytestmark = [pytest.mark.vllm, pytest.mark.needs_model]  # a real model and front end

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from collections import Counter
    from tests.support.fake_ledger import FakeLedger
    ledger = FakeLedger()
    import os
    os.environ["CHUNKLEDGER_URL"] = ledger.url
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from engine_hooks.events import Chunk, Finished, Step, Tokens
    from engine_hooks.vllm.scheduler import iter_schedulers
    from engine_hooks.vllm.cpu import engine_settings
    llm = LLM(sys.argv[1], **engine_settings().llm_kwargs(), enforce_eager=True,
              kv_cache_memory_bytes=64 << 20, max_num_batched_tokens=128,
              max_model_len=2048, async_scheduling=True,
              scheduler_cls="engine_hooks.vllm.AsyncLedgerScheduler")
    (sch,) = iter_schedulers(llm)
    ids = [[10 + (i * 7 + j) % 1200 for j in range(300 + 50 * i)] for i in range(3)]
    prompts = [TokensPrompt(prompt_token_ids=t) for t in ids]
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)
    sch.exporter.force_flush(10)
    ev = ledger.store.events
    by = lambda k, r: [e for e in ev if isinstance(e, k) and e.request_id == r]
    rids = sorted({e.request_id for e in ev if isinstance(e, Chunk)})
    print(json.dumps({
        "scheduler": type(sch).__name__,
        "errors": sch.hook_errors,
        "outputs": [len(o.outputs[0].token_ids) for o in outs],
        "chunk_tokens": [sum(c.tokens for c in by(Chunk, r)) for r in rids],
        "token_totals": [sum(t.count for t in by(Tokens, r)) for r in rids],
        "finished": [[f.reason, f.output_tokens] for r in rids for f in by(Finished, r)],
        "max_step_tokens": max(s.prefill_tokens + s.decode_tokens for s in ev if isinstance(s, Step)),
    }))
    """
)


def test_async_scheduler_variant_reports_the_same_stream(tiny_model: str, tmp_path: Path):
    env = {
        **os.environ,
        **vllm_env(tmp_path / "env"),
        **engine_settings().env,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "CHUNKLEDGER_SOURCE_ID": "vllm-async-test",
        "CHUNKLEDGER_SPOOL_DIR": str(tmp_path / "spool"),
        "CHUNKLEDGER_SPOOL_FSYNC": "0",
    }
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, tiny_model],
        cwd=ROOT,  # python -c imports from the working directory: tests.support
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    report = json.loads(lines[-1])
    assert report["scheduler"] == "AsyncLedgerScheduler" and report["errors"] == 0
    assert report["outputs"] == [20, 20, 20]
    assert sorted(report["chunk_tokens"]) == [300, 350, 400]  # no shared prefix: every prompt token once
    assert report["token_totals"] == [20, 20, 20]
    assert report["finished"] == [["length", 20]] * 3
    assert report["max_step_tokens"] <= 128
