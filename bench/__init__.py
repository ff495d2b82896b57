"""Benchmarks: each module has `run(out_dir) -> {"title", "markdown", "plots"}`, collected by `make bench`."""
