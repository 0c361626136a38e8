"""The ledger as a worker behind NATS JetStream: partitions leased among workers (``leases``), consumed,
stored and ruled, commands sent back (``worker``). The stream's contract: ``engine_hooks.streams``."""
