"""Padded batches: which columns of a transformers `[batch, q_len]` step hold real tokens.

`generate` left-pads rows; the cache must store only real tokens. This module reads the 2D
attention mask (and token ids, for prefix caching) of one step and returns, per row, the real
columns and their token ids. It checks the left-padding rule and raises a `ValueError` that names
the rows that break it; `is_left_padded` asks first (a right-padded batch is then stored whole, its
padding included, and masked by the model's own mask: see `planning`). It allocates nothing and
never touches the KV pool.
"""

from __future__ import annotations

import torch


def is_left_padded(attention_mask: torch.Tensor | None, num_cached_columns: int, had_tokens: list[bool],
                   q_len: int) -> bool:
    """Whether this step's new columns follow the left-padding rule `real_columns` needs (padding only
    before a row's first real token, none once a row stores tokens). A mask of the wrong shape counts
    as left-padded: `real_columns` then names the shape problem."""
    if attention_mask is None or attention_mask.dim() != 2 \
            or tuple(attention_mask.shape) != (len(had_tokens), num_cached_columns + q_len):
        return True
    bad, _ = _padding_violations(attention_mask, had_tokens, q_len)
    return not bool(bad.any())


def _padding_violations(attention_mask: torch.Tensor, had_tokens: list[bool], q_len: int):
    """([batch] bool: the row breaks the left-padding rule, [batch] real tokens in the new columns)."""
    new = attention_mask[:, attention_mask.shape[1] - q_len :].bool().cpu()
    num_real = new.sum(dim=1)
    left_padded = torch.arange(q_len)[None, :] >= (q_len - num_real)[:, None]
    bad = (new != left_padded).any(dim=1) | (torch.tensor(had_tokens, dtype=torch.bool) & (num_real < q_len))
    return bad, num_real


def real_columns(attention_mask: torch.Tensor | None, num_cached_columns: int, had_tokens: list[bool],
                 q_len: int) -> list[range]:
    """Per row, the columns of this step that hold real tokens (a suffix: left padding).

    Args:
        attention_mask: [batch, num_cached_columns + q_len] 2D padding mask (1 = real token), or None
            (every column is real).
        num_cached_columns: columns (padding included) already in the cache.
        had_tokens: per row, whether it already stores tokens (such a row may not pad again).
    """
    batch_size = len(had_tokens)
    if attention_mask is None:
        return [range(q_len)] * batch_size
    expected = (batch_size, num_cached_columns + q_len)
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != expected:
        raise ValueError(
            f"hf_paged: attention_mask must be 2D with shape {expected} (batch, cached + new columns), got "
            f"{tuple(attention_mask.shape)}: the step's tokens and its mask disagree (a model whose "
            "prepare_inputs_for_generation trims the tokens but not the mask, as MusicGen's does, cannot use a paged "
            "cache: load it with attn_implementation='sdpa' or 'eager')"
        )
    bad, num_real = _padding_violations(attention_mask, had_tokens, q_len)
    if bool(bad.any()):
        rows = bad.nonzero().flatten().tolist()
        raise ValueError(
            f"PagedCache needs left padding (padding only before a row's first real token; use "
            f"tokenizer.padding_side='left'); rows {rows} have padding after real tokens"
        )
    return [range(q_len - n, q_len) for n in num_real.tolist()]


def real_tokens(input_ids: torch.Tensor | None, cols: list[range]) -> list[list[int]]:
    """Per row, the token ids at its real columns; -1 (identity unknown) without `input_ids`."""
    if input_ids is None:
        return [[-1] * len(c) for c in cols]
    rows = input_ids.tolist()
    return [[rows[b][c] for c in row_cols] for b, row_cols in enumerate(cols)]
