"""OpenAI-compatible HTTP API on the gateway (`pdserve gateway --http-port`).

- protocol.py   request bodies -> GenerateInputs, each field checked (400 naming it)
- choices.py    a request's choices through Gateway.stream / generate (n, prompt lists)
- responses.py  deltas -> OpenAI JSON: responses, SSE chunks, usage, logprobs
- errors.py     OpenAI's error body; gRPC status -> HTTP status
- server.py     the Starlette app, served by uvicorn in the gateway's event loop
"""
