"""The fleet simulator's parts (``engine_hooks.simulator`` runs them): ``scenario``, ``engine``,
``gateway``, ``fleet``."""
