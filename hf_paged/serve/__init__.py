"""Serving front ends over the engine.

* `api_server`: `hf-paged serve`, an OpenAI-compatible HTTP server (FastAPI + uvicorn) over
  `AsyncEngine`, with its request checking in `openai_protocol` (torch-free).
* `disagg`: disaggregated prefill and decode workers, with its router policy (`router`,
  torch-free), control messages (`mailbox`), K/V transfer (`transfer`) and worker loop (`worker`).
* `models`: `ModelFromPath`, the model a command line names (a folder, `module:callable`, "default").

The top of the dependency chain, above `integrations`: it may use every other sub-package, and none
imports it.
"""
