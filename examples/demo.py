"""Run the hf_paged demo on the embedded default model (SmolLM2-135M-Instruct).

    python examples/demo.py            # or: hf-paged demo

The only change from stock transformers is `attn_implementation="hf_paged"`:

    import hf_paged
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="hf_paged")
    model.generate(**inputs)           # uses a PagedCache automatically
"""

import sys

from hf_paged.defaults.demo import run_demo

if __name__ == "__main__":
    sys.exit(0 if run_demo() else 1)
