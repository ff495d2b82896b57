"""Python-based Triton backends written by this project (a directory `<name>/model.py` is a backend named <name>)."""
