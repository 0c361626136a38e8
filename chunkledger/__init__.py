"""The ``chunkledger`` command line: where the parts meet.

The ledger (``ledger``), the engine hooks (``engine_hooks``: the exporter, the vLLM plugin, the gateway,
the simulator) and the dashboard (``dashboard``) do not know one another's commands; this package
imports them and composes one command line of them, and none of them imports it (an import contract).
``chunkledger.main`` is the console script and ``python -m chunkledger``; every other module here holds
the commands of the one part it is named for (``advice``: ``advise`` and ``profile``; ``gateway``: the
gateway; ``simulator``: ``simulate``; ...), and ``options``, ``reads`` and ``errors`` what the commands
that read a ledger share. Only this package imports typer.
Each module imports the heavy parts of what it drives only when a command runs, so ``--help`` is quick.
"""
