"""The HTTP front end: `hf-paged serve`, an OpenAI-compatible server (FastAPI + uvicorn).

* `api_server`: the app and the command line; it serves any `engine.EngineClient` (an `AsyncEngine`,
  or the disaggregated engine's async client, which the command line wires in for
  `--num-prefill/--num-decode`).
* `openai_protocol`: request checking and limits (torch-free). `openapi`: the request contract.

A front at the top of the dependency chain, beside `disagg`: it may use the chain below it, never
`disagg` (they meet only through the `EngineClient` protocol), and nothing imports it.
"""
