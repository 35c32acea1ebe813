"""One-off measurements, each behind a decision the README or the code cites.

Each module runs as `python -m pytgi_bench.experiments.NAME` (its docstring gives the command
and where its results went, mostly bench/results/cpu/). Not in the wheel and not tracked by
`make bench`: rerun one when the decision it backs is revisited. May import pytgi_bench.compare
(model builders, the server process) and the load tool; nothing imports them.
"""
