"""Analytics over the ledger tables: attribution, tails, ITL, "why was this slow", KV stalls."""
