"""`ReturnedCache`: the cache the engine route of `generate` returns (`return_dict_in_generate=True`)
and updates in place when it is passed back.

Stock generate returns a `DynamicCache` holding the K/V of every column it fed: the left-padded
prompts and every generated column but the last (`[rows, width + generated - 1]`, finished rows'
trailing pads included, attended). The engine computes no padding and stops finished rows, so it
holds less; what callers do with the cache still works:

* `get_seq_length()` is stock's column count.
* Passed back to `generate` (`cache=` / `past_key_values=`) with inputs that extend those columns
  (same ids and mask there), each row continues in the engine from the sequence it kept (its K/V
  reused, not recomputed): only the tokens after it are computed, including any stock computed but
  the engine never did (a finished row's end token and pads). The cache is then updated in place to
  the new state, as stock updates its own. The output equals stock's continuing from its cache.
* `crop`, `batch_select_indices`, `batch_repeat_interleave` and `reorder_cache` act on the kept
  rows (shortened, freed or shared copy-on-write in the engine's pool).
* Anything else (stock generate with it, a forward fed it, beam search...) turns it into what stock
  returned first: one dense forward over its columns fills it as the `DynamicCache` it subclasses,
  and the kept sequences are freed.

How long it holds blocks: a kept row holds its blocks in the model's engine pool until the cache
is garbage-collected, `reset()`, turned dense, or evicted (the engine frees kept rows when its pool
cannot otherwise admit new requests, and `hf_paged.release(model)` drops the engine and its pool).
A row that lost its blocks is recomputed when continued, with the same output.
"""

from __future__ import annotations

import copy
import inspect
import weakref

import torch
from transformers import DynamicCache

from ..core import KVSequence


class _Kept:
    """The engine sequences a `ReturnedCache` holds, apart from it so that a finaliser can free them
    without keeping the cache alive."""

    def __init__(self, engine, seqs: list[KVSequence | None]):
        self.engine_ref = weakref.ref(engine) if engine is not None else (lambda: None)
        self.seqs = seqs

    def engine(self):
        return self.engine_ref()

    def release(self) -> None:
        """Free every row's sequence: lock-free, from any thread (a finaliser's), applied by the engine
        before its next step (a sequence handed on to a request meanwhile is not touched)."""
        engine, seqs = self.engine_ref(), [s for s in self.seqs if s is not None]
        self.seqs = [None] * len(self.seqs)
        if engine is not None and seqs:
            engine.release_kv_later(seqs)


class ReturnedCache(DynamicCache):
    """See the module docstring. Built by the drop-in `generate`; not meant to be built by hand.

    Args:
        model: the model that generated.
        engine: the engine holding `seqs`.
        tokens: [rows, columns] the ids of the columns stock's cache would hold.
        mask: [rows, columns] their attention mask (the prompt's, then ones).
        seqs: per row, the engine's kept sequence (its real tokens' K/V, fewer than the row's real
            columns when it finished early) or None.
        images: the image inputs of every row's placeholders, in row order (a vision-language call),
            which `to_dense` hands the model with the ids.
    """

    def __init__(self, model, engine, tokens: torch.Tensor, mask: torch.Tensor, seqs: list[KVSequence | None],
                 images: dict | None = None):
        super().__init__(config=model.config)
        self._images = images
        self._model_ref = weakref.ref(model)
        self._kept = _Kept(engine, list(seqs))
        weakref.finalize(self, self._kept.release)
        # Each row's rotary history where the model's rope follows the length (`core.rope`): a row whose
        # blocks are lost by its continuation is recomputed with the frequencies stock gave it.
        self._ropes = [getattr(s, "rope", None) for s in seqs]
        self._tokens = tokens.detach().to("cpu", torch.long)
        self._mask = mask.detach().to("cpu", torch.long)
        self._dense = False

    def __deepcopy__(self, memo):
        """An independent copy (transformers' prompt-reuse recipe deep-copies a cache per request): kept
        rows are shared copy-on-write in the engine, each copy freeing its own; a dense one copies its
        tensors, as `DynamicCache` does."""
        new = ReturnedCache.__new__(ReturnedCache)
        memo[id(self)] = new
        state = copy.deepcopy({k: v for k, v in self.__dict__.items() if k not in ("_kept", "_model_ref")}, memo)
        engine = self._kept.engine()
        seqs = [engine.fork_kv(s) if engine is not None and s is not None else None for s in self._kept.seqs]
        state.update(_model_ref=self._model_ref, _kept=_Kept(engine, seqs))
        new.__dict__.update(state)
        weakref.finalize(new, state["_kept"].release)
        return new

    def __reduce__(self):
        raise TypeError("a ReturnedCache holds rows of a live engine and cannot be pickled; call to_dense() and "
                        "copy its layers' tensors")

    # ------------------------------------------------------------------ what the engine route reads
    @property
    def is_dense(self) -> bool:
        """Whether it became a plain `DynamicCache` (its K/V dense, nothing kept in an engine)."""
        return self._dense

    def continuation_prefixes(self, engine, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                              rows: list[list[int]]) -> list[KVSequence | None] | None:
        """Each row's kept sequence for a `generate` call continuing this cache in `engine` (None for a
        row whose blocks are gone or live in another engine), or None if the call does not extend the
        cache's columns (other ids or mask there, no new column, another batch size): stock semantics
        then need the dense cache.

        Args:
            input_ids, attention_mask: [rows, width] the call's inputs.
            rows: the call's rows, real tokens only (left padding removed).
        """
        if self._dense or any(seq is not None and seq.mm_spans for seq in self._kept.seqs):
            return None  # a row with images continues in stock generate (its placeholders need the images)
        num_rows, columns = self._tokens.shape
        if input_ids.shape[0] != num_rows or input_ids.shape[1] <= columns:
            return None
        mask = attention_mask[:, :columns].to("cpu", torch.long)
        if not torch.equal(mask, self._mask):
            return None
        real = self._mask.bool()
        if not torch.equal(input_ids[:, :columns].cpu()[real], self._tokens[real]):
            return None
        same_engine = engine is not None and self._kept.engine() is engine
        out = []
        for r, (seq, row) in enumerate(zip(self._kept.seqs, rows)):
            usable = (same_engine and seq is not None and engine.holds(seq) and seq.num_tokens < len(row)
                      and seq.token_ids == row[: seq.num_tokens])
            rope = self._ropes[r] if r < len(self._ropes) else None
            if not usable and rope is not None:
                # its blocks are gone: an empty sequence carrying the history, this call fed after the cached
                # columns (the engine recomputes the row with it)
                seq, usable = KVSequence(seq_id=-1, rope=rope.fed(int(self._mask[r].sum()), len(row))), True
            out.append(seq if usable else None)
        return out

    def adopt(self, engine, tokens: torch.Tensor, mask: torch.Tensor, seqs: list[KVSequence | None]) -> None:
        """Become the state after a call that continued it (stock updates its cache in place): the rows
        it handed to that call are the engine's now; whatever else it held is freed."""
        handed = {id(s) for s in seqs if s is not None}
        self._kept.seqs = [s for s in self._kept.seqs if s is not None and id(s) not in handed]
        self._kept.release()
        self._kept.engine_ref = weakref.ref(engine)
        self._kept.seqs = list(seqs)
        self._ropes = [getattr(s, "rope", None) for s in seqs]
        self._tokens = tokens.detach().to("cpu", torch.long)
        self._mask = mask.detach().to("cpu", torch.long)

    def release_rows(self) -> None:
        """Give up every engine row: after a call that failed or fell back to stock (the rows it took
        went with it; any others are freed). The rows are recomputed when continued."""
        self._kept.release()

    # ------------------------------------------------------------------ transformers' Cache API
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return super().get_seq_length(layer_idx) if self._dense else self._tokens.shape[1]

    @property
    def batch_size(self) -> int:
        return super().batch_size if self._dense else self._tokens.shape[0]

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        self.to_dense()
        return super().get_mask_sizes(query_length, layer_idx)

    def get_query_offset(self, layer_idx: int = 0) -> int:
        self.to_dense()
        return super().get_query_offset(layer_idx)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        self.to_dense()
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    # Reading the K/V makes it dense first (`cache.layers` itself is read as it stands).
    def __iter__(self):
        self.to_dense()
        return super().__iter__()

    @property
    def is_initialized(self) -> bool:
        return super().is_initialized if self._dense else self._tokens.shape[1] > 0

    def crop(self, tokens_to_remove: int) -> None:
        if self._dense:
            return super().crop(tokens_to_remove)
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}) with a positive value is not supported; pass a negative "
                             "number of tokens to remove")
        columns = self._tokens.shape[1] + tokens_to_remove
        if columns < 0:
            raise ValueError(f"cannot crop {-tokens_to_remove} tokens from a cache holding {self._tokens.shape[1]}")
        self._tokens, self._mask = self._tokens[:, :columns], self._mask[:, :columns]
        engine = self._kept.engine()
        for i, seq in enumerate(self._kept.seqs):
            real = int(self._mask[i].sum())
            if seq is not None and (engine is None or not engine.trim_kv(seq, real)):
                self._kept.seqs[i] = None

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        rows = torch.as_tensor(indices)
        rows = rows.nonzero().flatten() if rows.dtype == torch.bool else rows  # a row mask, as tensors index
        self._reindex(rows.tolist(), lambda: super(ReturnedCache, self).batch_select_indices(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        rows = [r for r in range(self.batch_size) for _ in range(repeats)]
        self._reindex(rows, lambda: super(ReturnedCache, self).batch_repeat_interleave(repeats))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._reindex(beam_idx.tolist(), lambda: super(ReturnedCache, self).reorder_cache(beam_idx))

    def reset(self) -> None:
        self._kept.release()
        self._tokens, self._mask = self._tokens[:, :0], self._mask[:, :0]
        super().reset()

    # ------------------------------------------------------------------ internals
    def _reindex(self, rows: list[int], dense_op) -> None:
        """Row i continues old row rows[i]: a row taken again shares the blocks (copy-on-write), a row
        not taken is freed."""
        if self._dense:
            return dense_op()
        bad = [r for r in rows if not 0 <= r < self._tokens.shape[0]]
        if bad:
            raise ValueError(f"row indices {bad} are out of range for a cache of {self._tokens.shape[0]} rows")
        engine, old, taken = self._kept.engine(), self._kept.seqs, set()
        seqs: list[KVSequence | None] = []
        for r in rows:
            if old[r] is None or engine is None:
                seqs.append(None)
            elif r in taken:
                seqs.append(engine.fork_kv(old[r]))
            else:
                taken.add(r)
                seqs.append(old[r])
        self._kept.seqs = [s for r, s in enumerate(old) if r not in taken]
        self._kept.release()
        self._kept.seqs = seqs
        index = torch.tensor(rows, dtype=torch.long)
        self._tokens, self._mask = self._tokens[index], self._mask[index]

    def to_dense(self) -> None:
        """Become exactly what stock returned: fill the K/V of every column (one forward over them
        with their mask, positions counted over real tokens as generate counts them) and free the
        kept rows. Idempotent.

        Raises:
            RuntimeError: the model it came from no longer exists.
        """
        if self._dense:
            return
        model = self._model_ref()
        if model is None:
            raise RuntimeError("the model this cache was generated with no longer exists")
        self._dense = True  # the forward below fills it through DynamicCache's own methods
        self._kept.release()
        if self._tokens.shape[1] == 0:
            return
        device = next(model.parameters()).device
        positions = (self._mask.cumsum(-1) - 1).clamp(min=0)
        key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        try:
            with torch.no_grad():
                images = {k: v.to(device) for k, v in (self._images or {}).items()}
                model(input_ids=self._tokens.to(device), attention_mask=self._mask.to(device),
                      position_ids=positions.to(device), use_cache=True, **images, **{key: self})
        except BaseException:
            super().reset()
            self._dense = False
            raise
