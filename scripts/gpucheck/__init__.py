"""The GPU acceptance run behind scripts/gpu_check.py (protocol, checks and tolerances: docs/gpu.md).

- needs.py: what the run needs beyond torch and Lightning, and how to install it offline
- steps.py: the steps (command, timeout, what passes) and the parsers of their output
- runner.py: each step in its own process group under its timeout and the run's budget; the report
- workers.py: the steps that run inside a child of gpu_check.py (t5 extrapolation and sampling times)
"""
