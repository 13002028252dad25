"""Scores of rows that finished early, as stock `generate` computes them.

Stock keeps feeding a finished row (pad tokens, attended, at consecutive positions) and reports its
scores and logits at the later steps too; the engine stops such a row at once. Those steps are
computed afterwards the way stock computes them: one teacher-forced dense forward of the row's whole
padded sequence (its prompt with stock's attention mask, its tokens, the pads after them; the
"hf_paged" attention without paged metadata is transformers' sdpa/eager), processed by stock's own
`LogitsProcessorList` with stock's `input_ids` at that step.
"""

from __future__ import annotations

import copy
import inspect

import torch

# Teacher-forced forwards for finished rows: rows per forward bounded by this many fp32 elements of
# kept logits plus hidden states.
_FORWARD_BUDGET = 1 << 26


def stock_rows_after_finish(model, gc, sequences: torch.Tensor, mask: torch.Tensor, width: int, samples,
                             params) -> tuple[tuple | None, tuple | None]:
    """Stock's `scores` / `logits` tuples: per generated step one fp32 [rows, vocab] tensor.

    A row's steps up to its end are the engine's rows. Stock computes the later steps of a finished
    row too: its forward on the token fed there (the row's last token, then pads), with the mask
    extended by ones, then its processors on `input_ids` as they stand (pads included). Those steps
    come from one teacher-forced forward of the row's padded sequence (all logits at once, kept for
    the missing positions only) and stock's own `LogitsProcessorList`, applied step by step to the
    rows missing that step, with those rows' `input_ids` at that step."""
    device = sequences.device
    total = sequences.shape[1] - width  # generated width
    lengths = [len(s.token_ids) for s in samples]
    short = [r for r, g in enumerate(lengths) if g < total]
    raw_late = teacher_forced_logits(model, sequences, mask, short, lengths, width) if short else {}
    late_scores: dict[int, list[torch.Tensor]] = {r: [] for r in short}
    if params.output_scores and short:
        processors_for: dict[tuple[int, ...], object] = {}
        for t in range(min(lengths[r] for r in short), total):
            group = tuple(r for r in short if lengths[r] <= t)
            if group not in processors_for:
                processors_for[group] = stock_processors(model, gc, mask[list(group)], width, device)
            x = torch.stack([raw_late[r][t - lengths[r]] for r in group])
            out = processors_for[group](sequences[list(group), : width + t], x.clone())
            for j, r in enumerate(group):
                late_scores[r].append(out[j])

    def steps(kind: str, late: dict[int, list[torch.Tensor]]) -> tuple:
        per_row = [[x.to(device=device, dtype=torch.float32) for x in getattr(s, kind)] + late.get(r, [])
                   for r, s in enumerate(samples)]
        return tuple(torch.stack([row[t] for row in per_row]) for t in range(total))

    scores = steps("scores", late_scores) if params.output_scores else None
    logits = steps("logits", raw_late) if params.output_logits else None
    return scores, logits


def teacher_forced_logits(model, sequences: torch.Tensor, mask: torch.Tensor, short: list[int],
                           lengths: list[int], width: int) -> dict[int, list[torch.Tensor]]:
    """Raw fp32 logits stock computes for each row of `short` after it finished: the rows of steps
    `lengths[r]` .. end, from one dense forward (no cache) of its sequence up to the last fed token,
    with stock's mask (prompt mask, then ones) and positions (cumulative mask - 1, as generate does)."""
    total = sequences.shape[1] - width
    length = width + total - 1  # the last generated token is never fed
    ids = sequences[:, :length]
    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], total - 1)], dim=1)
    positions = (full_mask.cumsum(-1) - 1).masked_fill(full_mask == 0, 0)
    model_device = next(model.parameters()).device
    keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
    hidden = getattr(model.config.get_text_config(), "hidden_size", 0) or 0
    vocab = output_vocab_size(model) or 1
    order = sorted(short, key=lambda r: lengths[r])  # most missing steps first
    out: dict[int, list[torch.Tensor]] = {}
    start = 0
    with torch.no_grad():
        while start < len(order):
            keep = total - lengths[order[start]]
            per_row = length * hidden + keep * vocab
            count = max(1, min(len(order) - start, _FORWARD_BUDGET // max(per_row, 1)))
            chunk = order[start: start + count]
            start += count
            extra = {"logits_to_keep": keep} if keeps_logits else {}
            result = model(input_ids=ids[chunk].to(model_device), attention_mask=full_mask[chunk].to(model_device),
                           position_ids=positions[chunk].to(model_device), use_cache=False, **extra)
            rows = result.logits[:, -keep:].to(device=sequences.device, dtype=torch.float32)
            for j, r in enumerate(chunk):
                missing = total - lengths[r]
                out[r] = list(rows[j, keep - missing:])
    return out


def stock_processors(model, gc, mask: torch.Tensor, width: int, device):
    """Stock's `LogitsProcessorList` for these rows (built as `generate` builds it, from the prepared
    config and the rows' attention mask, which the repetition penalty reads for the padding)."""
    gc = copy.deepcopy(gc)
    model._prepare_special_tokens(gc, True, device=device)
    return model._get_logits_processor(
        generation_config=gc, input_ids_seq_length=width, encoder_input_ids=None, prefix_allowed_tokens_fn=None,
        logits_processor=None, device=device, model_kwargs={"attention_mask": mask},
    )


def output_vocab_size(model) -> int | None:
    """The width of the model's logits (what stock's processors check token ids against)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    size = getattr(head, "out_features", None)
    if size is None:
        size = getattr(model.config.get_text_config(), "vocab_size", None)
    return size
