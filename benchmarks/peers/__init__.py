"""The parts of ``bench_peers.py``: the models it compares, the child processes that measure them, the report."""
