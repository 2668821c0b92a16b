"""The compiled cluster loop: the Python engine's results for the runs it covers, in a fraction
of the time (sim.engine.compiled.scope says which; benchmarks/README.md how fast)."""
