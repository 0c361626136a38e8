"""A model of vLLM v1's scheduler (0.32): one definition of a step's scheduling, used by the fleet
simulator (``engine_hooks.simulation``, which adds the events a step emits) and by the ledger's what-if
replay (``ledger.whatif``, which adds the step times).

Pure: no I/O, no clock, no events. ``settings`` (the engine configuration, and where a caller's model
departs from vLLM), ``state`` (the requests' counters, the running list, the waiting queue and the KV
pool), ``queues`` (the waiting queue's orders), ``reserve`` (the plugin's admission reserve) and
``schedule`` (one ``Scheduler.schedule()``, and the progress of a step that ran).
"""
