"""`hf-paged lm-eval ARGS`: lm-evaluation-harness's own command line, in a process where the
"hf_paged" attention is registered.

`lm_eval --model hf --model_args pretrained=DIR,attn_implementation=hf_paged` needs the name
"hf_paged" in transformers' attention registry when lm-eval loads the model, and lm-eval has no
plugin hook that would import hf_paged first (its model registry is not discovered from entry
points). So this command imports hf_paged, then hands its arguments, unchanged, to lm-eval's
`cli_evaluate`: `hf-paged lm-eval --model hf --model_args pretrained=DIR,attn_implementation=hf_paged
--tasks ...`. From Python, `import hf_paged` before `lm_eval.simple_evaluate(...)` does the same.

What then runs where (lm-eval's `hf` backend, unchanged): `generate_until` requests call
`model.generate(input_ids=..., stopping_criteria=..., do_sample=False)` on a left-padded batch,
which the engine serves (the stopping criteria are called step by step on the engine's rows);
`loglikelihood` requests call a plain forward with no cache, which takes hf_paged's dense path.
"""

from __future__ import annotations

import sys

from ..optional import require


def main(argv: list[str]) -> int:
    require("lm_eval", "eval", "hf-paged lm-eval")
    # Importing this module ran `hf_paged/__init__.py` first: the attention is registered.
    from lm_eval.__main__ import cli_evaluate

    saved = sys.argv
    sys.argv = ["lm_eval", *argv]
    try:
        cli_evaluate()
    except SystemExit as exc:  # argparse's --help and errors
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = saved
    return 0
