"""Packages of the demo models for runs on this machine: `make up`'s (make_up.py), the rehearsal's demo rankers
(demo.py), and the content-derived versions both give a package built here (versions.py). Below the CLI, the
rehearsal and the image check, which all publish them; never in a production path."""
