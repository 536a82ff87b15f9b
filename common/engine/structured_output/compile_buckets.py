"""Bounds of the constraint-compile-time histogram: shared by the engine, which counts
compiles per bucket, and the metrics that export them (torch-free, for the gateway's imports)."""

# Upper bounds in seconds; a last bucket takes everything slower.
COMPILE_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
