"""chunkledger's gateway: an OpenAI-compatible streaming proxy with an admission queue.

    chunkledger gateway --upstream http://127.0.0.1:8000 --port 8080 --ledger http://127.0.0.1:8321

``app.Gateway`` is the ASGI app, ``config.GatewayConfig`` its settings, ``admission.AdmissionQueue`` the
queue, ``server.uvicorn_config``/``server.ServerThread`` run it. See docs/gateway.md.
"""
