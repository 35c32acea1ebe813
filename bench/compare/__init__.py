"""The comparisons this repository tracks: `make bench` and bench/gpu.sh's stages.

`python -m pytgi_bench.compare` (run.py) puts pytgi beside transformers on one model and one
workload; `engine_steps` times the shard Engine's steps in-process; `build_model` and
`model_builder` make the random-weight checkpoints; `gpu_summary` ends bench/gpu.sh. Not in the
wheel (see pytgi_bench's docstring): it measures pytgi, users do not run it.
"""
