"""`make rehearse` (docs/rehearsal.md): a stack's model pods on this machine as their rendered Deployments say, each a
container of the image `make image` built. `run.py` drives it; every substitution for what only the cloud has is
listed in `substitutions.py`. The CLI (`llm-serving rehearse`) calls it; it imports nothing of the CLI."""
