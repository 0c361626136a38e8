"""What-if replay: recorded requests through a model of vLLM v1's scheduler (:mod:`ledger.whatif.model`)."""
