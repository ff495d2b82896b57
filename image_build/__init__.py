"""The serving image built and checked on this machine (docs/first-update.md, "The image built here"): `make image`
(build.py, with verify.py's checks on the built image), `make image-check` (check.py: the image run as a model pod),
`make image-lock` (locks.py), and the podman and buildah settings they and the rehearsal share (containers.py)."""
