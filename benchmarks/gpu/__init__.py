"""The GPU suite's steps, one module each, run by ``benchmarks/gpu_steps.py`` and launched by ``gpu_suite.py``."""
