"""The `llm-serving` command line: the one layer above both planes.

It imports the shared contracts (`llm_serving`), the serving image and, for `rollout`, the control plane; nothing
imports it. See docs/architecture.md ("Layers").
"""
