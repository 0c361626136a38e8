"""Fixtures for the real-vLLM tests: a tiny model built once, one in-process engine for the session.

The engine runs vLLM v1 in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) with
``engine_hooks.vllm.LedgerScheduler``, a 128-token budget and a 3072-token KV cache, prefix caching on
and ``scheduler_reserve_full_isl`` off (so KV pressure preempts). It starts without CHUNKLEDGER_URL;
each test attaches its own exporter (``attach``) with a fresh source id, so every test reads only its
own events.

``TEST_VLLM_ENGINE`` chooses the engine behind the ``engine`` fixture: ``cpu`` (the default, the
above) or ``synthetic``: vLLM's own engine core and scheduler (of the release first on ``PYTHONPATH``,
e.g. ``.cache/vllm/0.34.0``) over a synthetic device on a virtual clock
(:mod:`tests.engine_hooks.vllm.synthetic`), with async scheduling on when ``TEST_VLLM_OVERLAP=1``
and Model Runner V2's shape when ``TEST_VLLM_MRV2=1``. ``scripts/vllm_matrix.sh`` runs it per
release. Tests marked ``needs_model`` (a real model, vLLM's ``LLM`` or HTTP front end) are skipped there.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine_hooks.exporter import Exporter
from engine_hooks.vllm.cpu import engine_settings
from engine_hooks.vllm.tiny_model import build_tiny_model, vllm_env
from tests.engine_hooks.vllm import synthetic
from tests.engine_hooks.vllm.vllm_helpers import BUDGET, KV_TOKENS, Engine, attach_exporter

NEEDS_MODEL = "needs_model"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{NEEDS_MODEL}: needs a real model run (weights, tokens, vLLM's LLM or HTTP front end): "
        "skipped with the synthetic engine (TEST_VLLM_ENGINE=synthetic)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if synthetic.backend() != "synthetic":
        return
    skip = pytest.mark.skip(reason="needs a real model run; TEST_VLLM_ENGINE=synthetic has none")
    for item in items:
        if NEEDS_MODEL in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def vllm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="session")
def tiny_model(vllm_dir: Path) -> str:
    return build_tiny_model(vllm_dir / "tiny-llama")


@pytest.fixture(scope="session")
def engine(vllm_dir: Path, tiny_model: str) -> Iterator[Engine]:
    saved = {k: os.environ.get(k) for k in ("CHUNKLEDGER_URL", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    os.environ.update(vllm_env(vllm_dir / "env"))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.pop("CHUNKLEDGER_URL", None)
    if synthetic.backend() == "synthetic":
        yield from _synthetic_engine(tiny_model, saved)
        return
    settings = engine_settings()  # fp32 and one OpenMP thread on a small CPU host
    settings.apply_threads()
    from vllm import LLM

    llm = LLM(
        tiny_model,
        **settings.llm_kwargs(),
        enforce_eager=True,
        kv_cache_memory_bytes=KV_TOKENS * settings.kv_bytes_per_token(2, 128),  # 2 layers x (K, V) x 128
        max_num_batched_tokens=BUDGET,
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
        max_model_len=2048,
        max_num_seqs=16,
        scheduler_reserve_full_isl=False,
        scheduler_cls="engine_hooks.vllm.LedgerScheduler",
    )
    eng = Engine(llm)
    yield eng
    eng.scheduler.use_exporter(None)
    del llm
    _restore(saved)


def _synthetic_engine(tiny_model: str, saved: dict[str, str | None]) -> Iterator[Any]:
    """The synthetic engine (see the module docstring), torn down like the cpu one."""
    eng = synthetic.SyntheticEngine(tiny_model, overlap=synthetic.overlap(), mrv2=synthetic.mrv2())
    yield eng
    eng.scheduler.use_exporter(None)
    eng.close()
    _restore(saved)


def _restore(saved: dict[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def attach(engine: Engine, tmp_path: Path) -> Iterator[Callable[..., Exporter]]:
    """``attach(url, **settings)``: report the session engine's events to ``url`` for this test."""
    created: list[Exporter] = []
    options = engine.scheduler.options

    def attach_(url: str, **settings: Any) -> Exporter:
        exporter = attach_exporter(engine.scheduler, url, str(tmp_path / "spool"), **settings)
        created.append(exporter)
        return exporter

    yield attach_
    engine.abort_all()
    engine.scheduler.use_exporter(None)
    engine.scheduler.options = options
    engine.finished.clear()
    for exporter in created:
        exporter.shutdown(2.0)
