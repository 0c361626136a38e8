"""Builds the compiled loop detector (``ledger.rules._loopc``) and lists the packages; everything else is
in pyproject.toml.

The packages are the folders of the design (``chunkledger``, ``ledger``, ``engine_hooks``,
``dashboard``), and Alembic's ``migrations/`` is installed inside the ledger as ``ledger/migrations``
(``ledger.migrate`` finds it there, or at the top of a checkout): a top-level ``migrations`` package in
site-packages would collide with a user's own (Alembic projects have one), and pyproject.toml's
``packages.find`` cannot map a folder to another name.
"""

from setuptools import Extension, find_namespace_packages, setup

PARTS = ("chunkledger", "ledger", "engine_hooks", "dashboard")

setup(
    packages=[
        *find_namespace_packages(include=[f"{part}{tail}" for part in PARTS for tail in ("", ".*")]),
        "ledger.migrations",
        "ledger.migrations.versions",
    ],
    package_dir={"ledger.migrations": "migrations"},
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
    ],
)
