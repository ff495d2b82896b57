"""Metrics: the proxy on port 8002, merging Triton's metrics with vLLM's (docs/architecture.md §3.8).

Triton counts every request itself (the `nv_*` families); nothing here imitates it.

- `frontend`: `serve_exposition(body, port=8004)`, embedded Triton's metrics text on the internal port the proxy
  fetches (standalone Triton listens there itself); `FAMILY_NAMES`, Triton's per-model request families.
- `proxy`: `ProxyConfig`, `start_proxy` (thread) / `spawn_proxy` (child process), `python -m ...proxy`.
- `multiproc`: vLLM's multiprocess files; `clear_multiproc_dir(path)` for the startup procedure's step 3.
- `upstream`: fetching Triton's exposition with a deadline and a body cap.
- `exposition`, `openmetrics`, `formats`: the 0.0.4 model and parser, the two writers, content negotiation.
- `merge`: every family once, no duplicate series.
- `observability`: Grafana dashboard, alert rules and scrape config generated as code (deploy/observability/).
"""
