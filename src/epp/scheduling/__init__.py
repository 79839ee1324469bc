"""The scheduler: a pure, synchronous library (no I/O, no clocks, no globals).

filters narrow the candidates, weighted scorers rate them in [0, 1], a picker chooses.
The same code runs in the ext_proc server, the simulators and the tests.
"""
