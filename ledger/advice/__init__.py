"""Chunk-size advice: fit step time from ``steps`` rows, advise engine settings for an ITL target.

* ``fit``       the step-time model (least squares, term selection, coverage checks);
* ``advisor``   from a fit and the observed load to vLLM settings for an ITL target;
* ``query``     the steps of one model or source over a window (both backends);
* ``report``    the table the CLI prints;
* ``profile``   the plan of a profile run on a real engine, and the tables and fit of its steps (the
                driver that runs it on vLLM is ``engine_hooks.vllm.profile``);
* ``profile_answer`` the profile's report as records (its tables, fit and advice);
* ``scene``     the head-of-line scene sized from a profile's fit (the bench and the demo);
* ``answer``    ``AdviceQuery`` (what is asked, for the API and the CLI alike) and the answer's records;
* ``service``   ``chunk_size_advice``: the stages the API, the CLI (``--db``) and the bench share;
* ``defaults``  the defaults the CLI's options and the API's parameters show (no heavy imports).

The package itself imports nothing, so ``chunkledger --help`` does not load numpy or the store.
"""
