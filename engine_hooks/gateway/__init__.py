"""chunkledger's gateway: an OpenAI-compatible streaming proxy with an admission queue.

    chunkledger gateway --upstream http://127.0.0.1:8000 --port 8080 --ledger http://127.0.0.1:8321

``app.Gateway`` is the ASGI app (routes, admission, life cycle), ``exchange.Exchange`` one generation
request's context, ``request`` reads and checks the client's request, ``relay`` relays the upstream's
answer to the client (or ends it), ``responses`` what the gateway writes itself, ``upstream`` the
connections to the upstream, ``config.GatewayConfig`` its settings, ``admission.AdmissionQueue`` the
queue, ``server.uvicorn_config``/``server.ServerThread`` run it. See docs/gateway.md.
"""
