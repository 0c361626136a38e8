"""The engine settings chosen for the machine (engine_hooks.vllm.cpu): fp32 where bf16 would be
emulated, one OpenMP thread fewer than the cores when sharing them, the user's choice first, GPUs
left alone."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine_hooks.vllm.cpu import cpu_flags, engine_settings, has_native_bf16

EPYC_AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
SAPPHIRE_RAPIDS = "flags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
GRAVITON3 = "Features\t: fp asimd sve bf16 i8mm\n"


def test_cpu_flags_are_read_from_x86_and_arm_cpuinfo():
    assert {"avx2", "fma"} <= cpu_flags(EPYC_AVX2)
    assert "bf16" in cpu_flags(GRAVITON3)
    assert cpu_flags("no flags here") == frozenset()


def test_native_bf16_only_with_avx512_bf16_amx_or_arm_bf16():
    assert not has_native_bf16(cpu_flags(EPYC_AVX2))
    assert has_native_bf16(cpu_flags(SAPPHIRE_RAPIDS))
    assert has_native_bf16(cpu_flags(GRAVITON3))


def test_cpu_without_native_bf16_runs_fp32_with_one_thread_fewer_than_the_cores():
    s = engine_settings(device="cpu", environ={}, flags=cpu_flags(EPYC_AVX2), cores=2)
    assert s.dtype == "float32" and s.llm_kwargs() == {"dtype": "float32"}
    assert s.cli_args() == ["--dtype", "float32", "--distributed-executor-backend", "uni"]
    assert s.env == {"OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"} and s.threads == 1
    assert s.kv_bytes_per_token(2, 128) == 2 * 2 * 128 * 4
    assert "no native bf16" in s.describe() and "1 OpenMP thread" in s.describe()
    assert engine_settings(device="cpu", environ={}, flags=frozenset(), cores=8).threads == 7
    assert engine_settings(device="cpu", environ={}, flags=frozenset(), cores=1).threads == 1


def test_native_bf16_cpu_keeps_vllms_dtype_and_a_dedicated_engine_keeps_its_threads():
    s = engine_settings(
        device="cpu", environ={}, flags=cpu_flags(SAPPHIRE_RAPIDS), cores=2, shared_cores=False
    )
    assert s.dtype is None and s.llm_kwargs() == {} and s.cli_args() == [] and s.env == {}
    assert s.kv_bytes_per_token(2, 128) == 2 * 2 * 128 * 2


def test_the_users_dtype_and_omp_threads_win():
    s = engine_settings(
        device="cpu", dtype="bfloat16", environ={"OMP_NUM_THREADS": "2"}, flags=frozenset(), cores=2
    )
    assert s.dtype == "bfloat16" and s.env["OMP_NUM_THREADS"] == "2"
    assert engine_settings(device="cpu", dtype="auto", environ={}, flags=frozenset(), cores=2).dtype == (
        "float32"
    )


def test_a_shared_cpu_engine_runs_the_model_in_the_engine_core_unless_the_user_asked_for_workers():
    s = engine_settings(device="cpu", environ={}, flags=cpu_flags(SAPPHIRE_RAPIDS), cores=2)
    assert s.executor == "uni" and s.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert s.cli_args() == ["--distributed-executor-backend", "uni"]
    assert "the model in the engine core" in s.describe() and "sched_yield" in s.describe()
    # an in-process engine (the tests, benches and profile set it to 0 themselves) is the same choice
    inproc = engine_settings(
        device="cpu", environ={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, flags=frozenset(), cores=2
    )
    assert inproc.executor == "uni"
    given = engine_settings(
        device="cpu", environ={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, flags=frozenset(), cores=2
    )
    assert given.executor is None and given.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert "--distributed-executor-backend" not in given.cli_args()
    assert "given" in given.describe()


def test_gpu_engines_are_left_alone():
    s = engine_settings(device="gpu", environ={}, flags=frozenset(), cores=2)
    assert (s.dtype, s.env, s.cli_args()) == (None, {}, [])
    assert engine_settings(device="gpu", dtype="float16").cli_args() == ["--dtype", "float16"]


def test_module_prints_cli_args_and_env_for_shell_scripts():
    env = {"CHUNKLEDGER_ENGINE_DEVICE": "gpu", "PATH": "/usr/bin:/bin"}
    run = [sys.executable, "-m", "engine_hooks.vllm.cpu"]
    out = subprocess.run([*run, "--args"], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == ""
    env["CHUNKLEDGER_ENGINE_DEVICE"] = "cpu"
    env["OMP_NUM_THREADS"] = "3"
    out = subprocess.run([*run, "--env"], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "OMP_NUM_THREADS=3 VLLM_ENABLE_V1_MULTIPROCESSING=0"
    out = subprocess.run(run, capture_output=True, text=True, env=env, check=True)
    assert out.stdout.startswith("engine settings: device cpu")


def test_a_dtype_vllm_does_not_know_is_refused_naming_the_ones_it_does():
    with pytest.raises(ValueError, match=r"dtype: 'fp32' is not one of vLLM's auto, half, .*float32"):
        engine_settings(device="cpu", dtype="fp32", environ={}, flags=frozenset(), cores=2)
    assert engine_settings(device="gpu", dtype="float16").dtype == "float16"
