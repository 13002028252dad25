"""`GrammarLogitsProcessor`: a `StructuredOutputs` constraint as a transformers `LogitsProcessor`.

    from hf_paged.structured import GrammarLogitsProcessor, StructuredOutputs
    processor = GrammarLogitsProcessor(tokenizer, StructuredOutputs(json=schema))
    model.generate(**inputs, logits_processor=[processor])

It works in stock `generate` and in the drop-in engine (which runs a call's processors in lockstep:
`integrations/logits_processors.py`), greedy and sampled, with `num_return_sequences` (one matcher per
row). Unlike xgrammar's bundled `contrib.hf.LogitsProcessor` it is reusable across calls (a call with
other prompts starts afresh), its matchers advance under `python -O` too, and a row that stock pads
after a stopping criterion ended it stops being constrained instead of failing the call.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor

from .grammar import Grammars, GrammarMasks, GrammarState
from ..structured_outputs import StructuredOutputs


class GrammarLogitsProcessor(LogitsProcessor):
    """Masks, per row, the tokens that would break the row's constraint.

    Args:
        tokenizer: the model's tokenizer.
        structured: one `StructuredOutputs` for every row, or a list with one per row.
        stop_token_ids: the ids that end a row (default: the tokenizer's eos); a complete constraint
            allows only these.
    """

    def __init__(self, tokenizer, structured: StructuredOutputs | list[StructuredOutputs],
                 stop_token_ids: list[int] | None = None):
        specs = structured if isinstance(structured, list) else [structured]
        for spec in specs:
            if not isinstance(spec, StructuredOutputs):
                raise TypeError(f"structured must be a StructuredOutputs or a list of them, got {type(spec).__name__}")
            spec.validate()
        self.tokenizer = tokenizer
        self.specs = specs
        self.stop_token_ids = list(stop_token_ids) if stop_token_ids is not None else [tokenizer.eos_token_id]
        self._grammars: Grammars | None = None
        self._masks: GrammarMasks | None = None
        self._states: list[GrammarState | None] = []  # per row; None once the row is no longer constrained
        self._ids: torch.Tensor | None = None  # the input_ids of the last call

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.FloatTensor:
        # input_ids: [batch, length]; scores: [batch, vocab]
        if self._grammars is None or self._grammars.vocab_size != scores.shape[-1]:
            self._grammars = Grammars(self.tokenizer, scores.shape[-1], self.stop_token_ids)
            self._masks = GrammarMasks()
        if self._continues(input_ids):
            new = input_ids[:, self._ids.shape[1]:].tolist()
            for i, tokens in enumerate(new):
                state = self._states[i]
                if state is not None and not state.is_terminated and not state.accept(tokens):
                    self._states[i] = None  # a pad after the row ended some other way: no longer constrained
        else:  # a new call: every row starts at its grammar's start
            if len(self.specs) not in (1, input_ids.shape[0]):
                raise ValueError(f"GrammarLogitsProcessor has {len(self.specs)} constraints for a batch of "
                                 f"{input_ids.shape[0]} rows")
            specs = self.specs * input_ids.shape[0] if len(self.specs) == 1 else self.specs
            self._states = [self._grammars.state(spec) for spec in specs]
        self._ids = input_ids
        rows = [(i, s, ()) for i, s in enumerate(self._states) if s is not None]
        if rows:
            self._masks.apply(scores, rows)
        return scores

    def _continues(self, input_ids: torch.Tensor) -> bool:
        """Whether this call is the next step of the last one (the same rows, grown by new columns)."""
        last = self._ids
        return (last is not None and last.shape[0] == input_ids.shape[0] and input_ids.shape[1] > last.shape[1]
                and torch.equal(input_ids[:, : last.shape[1]], last.to(input_ids.device)))
