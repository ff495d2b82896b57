"""Metrics: the proxy on port 8002 and the local front-ends' Triton-named request metrics (ARCHITECTURE §3.8).

- `frontend`: `FrontendMetrics.observe(...)` per request, `serve_frontend_metrics(metrics, port=8004)`.
- `proxy`: `ProxyConfig`, `start_proxy` (thread) / `spawn_proxy` (child process), `python -m ...proxy`.
- `multiproc`: `clear_multiproc_dir(path)` for the startup procedure's step 3.
- `observability`: Grafana dashboards and Prometheus alert rules generated as code (deploy/observability/).
"""
