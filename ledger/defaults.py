"""Where the ledger listens and stores by default: one place for the CLI, the settings and the clients.

Imports nothing, so the command line can show these in its help without loading the service.
"""

DEFAULT_PORT = 8321
DEFAULT_LEDGER_URL = f"http://127.0.0.1:{DEFAULT_PORT}"
DEFAULT_DB_URL = "duckdb:///./chunkledger.duckdb"
# where the clients find the ledger's URL, first set wins (CHUNKLEDGER_URL: what the exporters read)
LEDGER_URL_ENV = ("CHUNKLEDGER_LEDGER_URL", "CHUNKLEDGER_URL")
