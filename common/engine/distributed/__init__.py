"""Multi-rank execution: process groups for tensor and pipeline parallelism and their collectives."""
