"""Structured generation: output constrained to a JSON schema, a JSON object, a regex, a choice list, an
EBNF or Lark grammar, or a structural tag (tool calls).

* `StructuredOutputs` (`hf_paged.structured_outputs`, a torch-free leaf): the constraint, as `SamplingParams(structured=...)`.
* `grammar.py`: the backend (xgrammar, the `structured` extra): `Grammars` compiles each distinct
  constraint once per engine and caches it; `GrammarState` is one request's matcher; and
  `GrammarMasks.apply` builds the token bitmask of every constrained row of a step and applies it in
  one batched pass.
* `processor.py`: `GrammarLogitsProcessor`, the same constraint as a transformers `LogitsProcessor`, for
  `model.generate(logits_processor=[...])` (which the drop-in engine runs too).
"""

from ..structured_outputs import StructuredOutputs


def __getattr__(name):  # the processor needs the `structured` extra: imported on first use
    if name == "GrammarLogitsProcessor":
        from .processor import GrammarLogitsProcessor
        return GrammarLogitsProcessor
    raise AttributeError(name)


__all__ = ["GrammarLogitsProcessor", "StructuredOutputs"]
