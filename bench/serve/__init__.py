"""Serving benchmark client: `pdserve bench serve` (bench.serve.main).

Drives the gateway's public GenerateStream API (or, --backend openai, any
OpenAI-compatible /v1/completions) with generated datasets at a chosen
arrival process and reports vLLM `vllm bench serve` metrics (TTFT, TPOT, ITL, E2EL,
throughputs, goodput), so figures compare with published vLLM numbers.

- metrics.py   per-request outcomes -> the report's figures (vLLM definitions)
- arrivals.py  gamma inter-arrival gaps (Poisson at burstiness 1)
- datasets.py  random, sharegpt-like and prefix-repetition prompts, offline
- client.py    the backend interface, the gRPC and OpenAI HTTP backends, the request pacing loop
- ../fakes/fake_generate.py  the in-process fake GenerateService the client self-check runs against
- plots.py     latency CDFs and rate-sweep charts (matplotlib, optional)
- main.py      the command line
"""
