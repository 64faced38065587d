"""Every GPU check and benchmark in one call: `python -m tools.gpu_suite --help` (see __main__.py)."""
