"""The training-speed benchmark behind scripts/bench.py (protocol and fields: docs/benchmark.md).

- reference.py: the independent nanoGPT-style GPT and optimizer the bench compares pelab with
- conf.py: what is read from conf/ and pelab (the one import of pelab's harness)
- paths.py: the timed training paths (reference loop, pelab's model in it, pelab's Lightning fit)
- harness.py: one process per path, the baton, the rotating rounds, the step clock
- probes.py: peak memory and evaluation, each in a fresh child
- report.py: rows, paired ratios and their intervals, the table
- overhead.py: the harness's Python cost per step, a near-free model in the plain loop and in pelab's fit
"""
