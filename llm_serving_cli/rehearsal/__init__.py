"""`make rehearse`: a stack's model pods on this machine as their rendered Deployments say (issue 16,
docs/rehearsal.md). `run.py` drives it; every substitution for what only the image or the cloud has is listed in
`substitutions.py`."""
