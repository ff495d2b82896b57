"""Rollouts as stack updates (docs/architecture.md §4, docs/rollouts.md).

- `planner`: the pure red-black arithmetic (replicas, weights, schedules within replicas + surge, GPU cost);
  no Pulumi import, the program and the bench use it too.
- `stackfile`: in-place edits of a stack config file (ruamel.yaml round trip), validated by the program's schema.
- `runner`: stack runners (Automation API; the mock runtime plus `engine`; the fast `graph`).
- `engine`: what `pulumi up` and Kubernetes do with a resource graph, simulated for the mock runners.
- `gate`: Prometheus HTTP API client, the analysis gate and the idle-version count.
- `orchestrate`: start/advance/abort/status across stacks in waves; `cli`: `llm-serving rollout`.
"""
