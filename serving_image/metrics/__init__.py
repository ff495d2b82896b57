"""Metrics: the proxy on port 8002 and the local front-ends' Triton-named request metrics (docs/architecture.md §3.8).

- `frontend`: `FrontendMetrics.observe(...)` per request, `serve_frontend_metrics(metrics, port=8004)`.
- `proxy`: `ProxyConfig`, `start_proxy` (thread) / `spawn_proxy` (child process), `python -m ...proxy`.
- `multiproc`: vLLM's multiprocess files; `clear_multiproc_dir(path)` for the startup procedure's step 3.
- `upstream`: fetching Triton's (or the front-ends') exposition with a deadline and a body cap.
- `exposition`, `openmetrics`, `formats`: the 0.0.4 model and parser, the two writers, content negotiation.
- `merge`: every family once, no duplicate series.
- `observability`: Grafana dashboard, alert rules and scrape config generated as code (deploy/observability/).
"""
