"""What the plugin decides from vLLM's version and config before it schedules anything: the class that
keeps vLLM's async overlap, the tested range, the source each data-parallel rank reports as, and the
LoRA guard of the arrivals-first hold-out."""

from __future__ import annotations

import logging
import socket
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.v1.core.sched.async_scheduler import AsyncScheduler

from engine_hooks.vllm import compat
from engine_hooks.vllm.scheduler import AsyncLedgerScheduler, LedgerScheduler, source_id


def _config(async_scheduling: bool) -> Any:
    return SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=async_scheduling))


@pytest.mark.parametrize("as_keyword", [True, False])
def test_ledger_scheduler_is_built_as_the_async_class_when_async_scheduling_is_on(as_keyword):
    config = _config(True)
    args, kwargs = ((), {"vllm_config": config}) if as_keyword else ((config,), {})
    built = LedgerScheduler.__new__(LedgerScheduler, *args, **kwargs)
    assert type(built) is AsyncLedgerScheduler
    assert isinstance(built, AsyncScheduler) and isinstance(built, LedgerScheduler)


def test_ledger_scheduler_stays_the_lock_step_class_when_async_scheduling_is_off():
    built = LedgerScheduler.__new__(LedgerScheduler, vllm_config=_config(False))
    assert type(built) is LedgerScheduler
    assert not isinstance(built, AsyncScheduler)


def test_naming_the_async_class_keeps_it_in_either_mode():
    for on in (True, False):
        assert type(AsyncLedgerScheduler.__new__(AsyncLedgerScheduler, vllm_config=_config(on))) is (
            AsyncLedgerScheduler
        )


@pytest.mark.parametrize(
    ("version", "inside"),
    [
        ("0.32.0", True),
        ("0.32.0+cpu", True),
        ("0.33.0", True),
        ("0.34.0+cu129", True),
        ("0.34.2", True),
        ("0.31.1", False),
        ("0.35.0", False),
        ("1.0.0", False),
        ("", False),
    ],
)
def test_a_vllm_outside_the_tested_range_logs_one_warning_naming_the_range(version, inside, caplog):
    with caplog.at_level(logging.WARNING, logger=compat.__name__):
        assert compat.check_version(version) is inside
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if inside:
        assert warnings == []
    else:
        assert len(warnings) == 1 and "0.32 to 0.34" in warnings[0], warnings


def _req(rid: str, lora_id: int | None) -> Any:
    lora = None if lora_id is None else SimpleNamespace(lora_int_id=lora_id)
    return SimpleNamespace(request_id=rid, lora_request=lora)


def test_a_prefill_whose_lora_is_its_own_is_not_held_out_while_a_new_lora_waits():
    long, other = _req("long", 7), _req("other", 3)
    scheduler = SimpleNamespace(
        lora_config=SimpleNamespace(max_loras=2), running=[long, other], waiting=[_req("new", 9)]
    )
    assert not compat.can_hold_out(scheduler, long)  # vLLM could admit LoRA 9 in its place: 3 in use
    scheduler.running.append(_req("same", 7))
    assert compat.can_hold_out(scheduler, long)  # LoRA 7 stays counted through the other request


def test_a_prefill_whose_lora_is_its_own_is_held_out_when_the_waiting_add_no_lora():
    long, other = _req("long", 7), _req("other", 3)
    waiting = [_req("same", 7), _req("running-one", 3), _req("base", None), _req("base0", 0)]
    scheduler = SimpleNamespace(
        lora_config=SimpleNamespace(max_loras=2), running=[long, other], waiting=waiting
    )
    assert compat.can_hold_out(scheduler, long)
    scheduler.kv_holding_waiting = [_req("resuming", 9)]  # vLLM's other waiting queue counts too
    assert not compat.can_hold_out(scheduler, long)


def test_without_lora_or_for_the_base_model_any_prefill_can_be_held_out():
    assert compat.can_hold_out(SimpleNamespace(lora_config=None, running=[], waiting=[]), _req("a", 5))
    scheduler = SimpleNamespace(lora_config=SimpleNamespace(max_loras=1), running=[], waiting=[])
    assert compat.can_hold_out(scheduler, _req("a", None))
    assert compat.can_hold_out(scheduler, _req("b", 0))


def _parallel(size: int, index: int) -> Any:
    parallel = SimpleNamespace(data_parallel_size=size, data_parallel_index=index)
    return SimpleNamespace(parallel_config=parallel)


def test_data_parallel_ranks_report_as_distinct_sources_without_configuration():
    host = socket.gethostname()
    assert source_id(_parallel(1, 0), None) == f"vllm-{host}"[:100]
    ranks = [source_id(_parallel(4, rank), None) for rank in range(4)]
    assert ranks == [f"vllm-{host}"[:100] + f"-dp{rank}" for rank in range(4)]


def test_a_configured_source_id_is_kept_and_gets_the_rank_under_data_parallelism():
    assert source_id(_parallel(1, 0), "vllm-a") == "vllm-a"
    assert [source_id(_parallel(2, r), "vllm-a") for r in (0, 1)] == ["vllm-a-dp0", "vllm-a-dp1"]
    long = "x" * 128
    assert len(source_id(_parallel(2, 1), long)) == 128 and source_id(_parallel(2, 1), long).endswith("-dp1")


def _cadence(interval: int, executed: int, last_prefill: int, bound: bool = False) -> Any:
    running = [SimpleNamespace(is_prefill_chunk=True), SimpleNamespace(is_prefill_chunk=False)]
    return SimpleNamespace(
        running=running,
        prefill_capacity_bound=bound,
        local_prefill_interval=interval,
        num_executed_steps=executed,
        last_prefill_step=last_prefill,
    )


def test_prefills_are_held_on_the_steps_vllms_prefill_cadence_skips():
    # prefill_schedule_interval 3 (vLLM 0.33+ without data parallelism): a prefill at executed step 10,
    # then steps 11 and 12 decode only, 13 may prefill again.
    assert [compat.prefills_held(_cadence(3, executed, 10), False) for executed in (10, 11, 12)] == [
        True,
        True,
        False,
    ]
    assert not compat.prefills_held(_cadence(1, 10, 10), False)  # no cadence
    assert not compat.prefills_held(_cadence(3, 10, 10, bound=True), False)  # vLLM's capacity escape


def test_prefills_are_held_when_the_data_parallel_core_throttles_and_someone_decodes():
    assert compat.prefills_held(_cadence(1, 0, -1), True)
    only_prefills = _cadence(1, 0, -1)
    only_prefills.running = [SimpleNamespace(is_prefill_chunk=True)]
    assert not compat.prefills_held(only_prefills, True)  # vLLM never defers with nothing to decode
    vllm_032 = SimpleNamespace(running=_cadence(1, 0, -1).running, prefill_capacity_bound=False)
    assert not compat.prefills_held(vllm_032, False)  # 0.32 has no local cadence


class _Manager:
    def allocate_slots(self, request: Any) -> str:
        return f"allocated {request}"


def test_allocations_are_tracked_only_while_a_victim_chooser_is_set_and_a_patch_of_vllms_stays():
    manager = _Manager()
    scheduler = SimpleNamespace(kv_cache_manager=manager, running=[], _cl_current=None)
    compat.set_victim_chooser(scheduler, lambda running: None)
    assert manager.allocate_slots("r1") == "allocated r1" and scheduler._cl_current == "r1"
    compat.set_victim_chooser(scheduler, None)
    assert "allocate_slots" not in vars(manager) and not compat.victim_chooser_set(scheduler)

    def patched(request: Any) -> str:  # a test's (or another plugin's) own patch on the instance
        return "patched"

    manager.allocate_slots = patched
    compat.set_victim_chooser(scheduler, lambda running: None)
    assert manager.allocate_slots("r2") == "patched" and scheduler._cl_current == "r2"
    compat.set_victim_chooser(scheduler, None)
    assert vars(manager)["allocate_slots"] is patched
    assert not compat.victim_chooser_set(scheduler)
    compat.set_victim_chooser(scheduler, None)  # nothing of ours left: the patch stays
    assert vars(manager)["allocate_slots"] is patched
