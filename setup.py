"""Builds the compiled loop detector (``ledger.rules._loopc``); everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "ledger.rules._loopc",
            sources=["ledger/rules/_loopc.c"],
            extra_compile_args=[
                "-O2",
                "-Wall",
                "-Wextra",
                "-Wno-unused-parameter",
                "-Wno-missing-field-initializers",
            ],
        )
    ]
)
