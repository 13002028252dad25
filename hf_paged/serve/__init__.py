"""The HTTP front end: `hf-paged serve`, an OpenAI-compatible server (FastAPI + uvicorn).

* `api_server`: the app; it serves any `engine.EngineClient` (an `AsyncEngine`, or the disaggregated
  engine's async client, which `launch` wires in for `--num-prefill/--num-decode`).
* `launch`: the command line (`hf-paged serve`): checks, placement, the start-up banner.
* `tool_calls`, `tools`: tool calls in the model's own format, and the request fields about them.
* `openai_protocol`: request checking and limits (torch-free). `openapi`: the request contract.

A front at the top of the dependency chain, beside `disagg`: it may use the chain below it, never
`disagg` (they meet only through the `EngineClient` protocol), and nothing imports it.
"""
