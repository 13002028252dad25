"""`LengthRope`: which rotary frequencies each token of a sequence was computed with, where they depend on length.

Most rotary embeddings depend on the position alone. Two of transformers' rope types do not:
- "dynamic" (NTK): a forward whose sequence ends at `S > threshold` rotates with frequencies computed
  for `S`; below the threshold, the original ones.
- "longrope": a forward whose sequence ends past `original_max_position_embeddings` uses the long
  factors, otherwise the short ones.

transformers takes `S` from the largest position in the whole forward, so it is per sequence only when
a sequence runs alone. hf_paged reproduces that run alone, token by token: stock feeds a prompt (or a
returned cache's continuation) in one forward ending at its last token, and each generated token in a
forward of its own, so token `p` was computed for `S(p) = end of its prompt span` inside a span and
`p + 1` after it. Keys keep the frequencies they were written with, so a recomputed sequence (a
preemption) gets back exactly its keys.

Phi-3's `prepare_inputs_for_generation` (and PhiMoE's, Phi-4-multimodal's) instead drops the cache when
the sequence first grows past the threshold and recomputes every token with the long factors
(`recompute`): once `long`, every token of the sequence is computed for `S > threshold`, and the
scheduler restarts a sequence whose short-factor keys that crossing makes stale.

Blocks hold keys rotated for their tokens' `S`, so the prefix cache salts each block whose tokens are
not at the original frequencies with what they were computed for (`block_salt`).

Plain data, torch-free: the scheduler and the block manager read it; `hf.rope` turns `S` into
frequencies.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

LENGTH_ROPE_KINDS = ("dynamic", "longrope")


@dataclass(frozen=True)
class LengthRope:
    """How one sequence's rotary frequencies follow its length.

    Attributes:
        kind: "dynamic" or "longrope".
        threshold: the length up to which the original (short) frequencies hold: `max_position_embeddings`
            for dynamic NTK, `original_max_position_embeddings` for longrope (the smallest over layer types).
        recompute: stock drops and recomputes the whole cache when the sequence first passes the threshold.
        spans: `(start, end)` position ranges that stock feeds in one forward (the prompt, a continuation).
        long: every token is (to be) computed with the long factors (`recompute` only).
    """

    kind: str
    threshold: int
    recompute: bool = False
    spans: tuple[tuple[int, int], ...] = ()
    long: bool = False

    def __post_init__(self):
        if self.kind not in LENGTH_ROPE_KINDS:
            raise ValueError(f"LengthRope.kind must be one of {LENGTH_ROPE_KINDS}, got {self.kind!r}")
        if self.threshold < 1:
            raise ValueError(f"LengthRope.threshold must be >= 1, got {self.threshold}")

    def fed(self, start: int, end: int) -> "LengthRope":
        """This history with positions `start .. end - 1` fed as one forward (a prompt, a continuation);
        for `recompute`, long from the start when `end` passes the threshold."""
        if end <= start:
            return self
        # Earlier spans stay whole (a kept prefix cropped inside its prompt keeps its tokens' lengths);
        # the newest span containing a position decides (`rope_len`).
        spans = tuple(s for s in self.spans if s[0] < start) + ((start, end),)
        return replace(self, spans=spans, long=self.long or (self.recompute and end > self.threshold and start == 0))

    def continuing(self, kept: "LengthRope | None", held: int, prompt_len: int) -> "LengthRope":
        """The history of a kept sequence of `held` tokens that this request's prompt of `prompt_len` tokens
        continues: fed in one forward after them (as stock continues a returned cache). A sequence handed
        over without its history (another engine's prefill) was fed as this prompt: this one."""
        return self if kept is None else kept.fed(held, prompt_len)

    def rope_len(self, position: int) -> int:
        """The sequence length `S` stock computed the token at `position` for."""
        length = position + 1
        for start, end in reversed(self.spans):
            if start <= position < end:
                length = end
                break
        if self.long:
            return max(length, self.threshold + 1)
        return length

    def needs_restart(self, length: int) -> bool:
        """Whether a sequence growing to `length` tokens must be recomputed (its keys are short-factor)."""
        return self.recompute and not self.long and length > self.threshold

    def restarted(self) -> "LengthRope":
        """The history of the same sequence recomputed from scratch with the long factors."""
        return replace(self, long=True)

    def block_salt(self, lo: int, hi: int) -> object:
        """What distinguishes block `lo .. hi - 1`'s keys from the same tokens' at the original
        frequencies: None when every token is at the original ones."""
        lens = [self.rope_len(p) for p in range(lo, hi)]
        if all(s <= self.threshold for s in lens):
            return None
        if self.kind == "longrope":  # two sets of factors: which tokens took the long ones
            return ("longrope", tuple(s > self.threshold for s in lens))
        return ("dynamic", tuple(s if s > self.threshold else 0 for s in lens))
