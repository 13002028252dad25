"""Request intake: a caller's prompt and `SamplingParams` become a registered `TrackedRequest`, or a
ValueError / TypeError that names what is wrong (nothing is queued then).

Runs on the caller's thread; it takes only the tokenizer's lock and the core's registry lock, never
the engine's step lock, so a submitter never waits for a running step. A structured request's grammar
compiles on the grammar compile threads (`structured.grammar.Grammars`), within a time limit: a front
may compile it first (`compile_grammar`) and hand it to `track`, so that no intake thread waits for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence as SequenceABC

from ..config import (DEFAULT_GRAMMAR_CACHE_BYTES, DEFAULT_GRAMMAR_COMPILE_TIMEOUT_SECONDS,
                      DEFAULT_GRAMMAR_MASK_BUDGET_SECONDS)
from ..core import KVSequence, LengthRope, Request
from ..hf import KVOwner
from ..hf.multimodal import ImageSupport
from ..sampling_params import SamplingParams
from ..worker.sampling import draw_seed
from .core import EngineCore
from .delivery import Inbox
from .inputs import prompt_token_ids
from .metrics import RequestMetrics
from .output_processor import OutputProcessor
from .tracked import RequestGroup, TrackedRequest


class Intake:
    """Checks and registers the engine's new requests (see `Engine.add_owned_request`; the grammar
    limits are `Engine`'s arguments of the same names)."""

    def __init__(self, core: EngineCore, kv: KVOwner, outputs: OutputProcessor, tokenizer,
                 tokenizer_lock: threading.Lock, vocab_size: int, images: ImageSupport | None = None,
                 logits_width: int | None = None, length_rope: LengthRope | None = None, *,
                 grammar_cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES,
                 grammar_compile_timeout_seconds: float | None = DEFAULT_GRAMMAR_COMPILE_TIMEOUT_SECONDS,
                 grammar_mask_budget_seconds: float | None = DEFAULT_GRAMMAR_MASK_BUDGET_SECONDS):
        if isinstance(grammar_cache_bytes, bool) or not isinstance(grammar_cache_bytes, int) or grammar_cache_bytes < 0:
            raise ValueError(f"grammar_cache_bytes must be an integer >= 0, got {grammar_cache_bytes!r}")
        for name, value in (("grammar_compile_timeout_seconds", grammar_compile_timeout_seconds),
                            ("grammar_mask_budget_seconds", grammar_mask_budget_seconds)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise ValueError(f"{name} must be a positive number of seconds or None (no limit), got {value!r}")
        self.grammar_limits = dict(cache_bytes=grammar_cache_bytes,
                                   compile_timeout_seconds=grammar_compile_timeout_seconds,
                                   mask_budget_seconds=grammar_mask_budget_seconds)
        self.core = core
        self.kv = kv
        self.outputs = outputs
        self.tokenizer = tokenizer
        self.tokenizer_lock = tokenizer_lock
        self.vocab_size = vocab_size
        self.images = images  # splits a prompt's multi_modal_data per image
        self.logits_width = logits_width or vocab_size
        self.length_rope = length_rope  # what each sequence records where the rope follows its length
        self.grammars = None  # `structured.grammar.Grammars`, made for the first structured request
        self._grammars_lock = threading.Lock()

    def track(self, prompt, sampling_params: SamplingParams | None, request_id: str | None, inbox: Inbox | None,
              index: int, streamed: bool, kv_prefix: KVSequence | None, retain_kv: bool,
              resume_tokens: SequenceABC[int], compiled_grammar=None) -> TrackedRequest:
        """A registered request, ready to be queued; see `Engine.add_owned_request` for the arguments."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.validate(self.vocab_size)
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass tokenizer= to the Engine")
        prompt, images = self._split_prompt(prompt)
        if images and kv_prefix is not None:
            raise ValueError("kv_prefix cannot continue a request with images")
        if isinstance(prompt, str):
            with self.tokenizer_lock:
                prompt_ids = prompt_token_ids(prompt, self.tokenizer, self.vocab_size)
        else:
            prompt_ids = prompt_token_ids(prompt, self.tokenizer, self.vocab_size)
        resume = [int(t) for t in resume_tokens]
        if resume:
            if params.n != 1:
                raise ValueError("resume_tokens needs a request with n=1")
            if len(resume) >= params.max_new_tokens:
                raise ValueError(f"{len(resume)} resume_tokens leave nothing to generate within "
                                 f"max_new_tokens={params.max_new_tokens}")
            prompt_token_ids(resume, None, self.vocab_size)  # ids inside the vocabulary
        if len(prompt_ids) + len(resume) >= self.core.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens leaves no room to generate within the model's "
                f"max_model_len={self.core.max_model_len}"
            )
        known = list(prompt_ids) + resume  # what the request's sequence will hold
        if kv_prefix is not None and (not isinstance(kv_prefix, KVSequence) or kv_prefix.num_tokens >= len(known)
                                      or kv_prefix.token_ids != known[: kv_prefix.num_tokens]):
            raise ValueError("kv_prefix must be a KVSequence holding a proper prefix of the prompt's tokens")
        max_total = min(len(prompt_ids) + params.max_new_tokens, self.core.max_model_len)
        scheduler = self.core.scheduler
        if not scheduler.can_ever_fit(max_total):
            raise ValueError(
                f"request may grow to {max_total} tokens, which needs {scheduler.max_blocks_for(max_total)} "
                f"KV blocks of {self.kv.block_size}, but the pool has only {self.kv.num_blocks}; "
                "shorten the prompt or max_new_tokens, or enlarge the pool"
            )
        grammar = self._grammar(params, compiled_grammar)
        detok = self.outputs.new_detokenizer(prompt_ids, params, streamed)
        if detok is not None:
            # Their text comes out with this engine's first event, so that the streamed deltas join
            # to the whole output's text (the other engine's own text may have held back a partial
            # character or a stop-string prefix).
            resume_text = "".join(detok.add(token) for token in resume)
        core = self.core
        with core.registry_lock:  # ids are unique among live requests, whichever thread adds them
            if request_id is None:
                request_id = core.new_request_id()
            elif core.is_live(request_id):
                raise ValueError(f"request_id {request_id!r} is already in use by a live request")
            request = Request(request_id=request_id, token_ids=known, num_prompt_tokens=len(prompt_ids),
                              max_total_tokens=max_total, seq=self.kv.new_sequence(),
                              use_prefix_cache=params.prompt_logprobs is None)  # its prompt's logits are needed
            if self.length_rope is not None:  # stock feeds the prompt in one forward, then a token per forward
                request.seq.rope = self.length_rope.fed(0, len(prompt_ids))
            metrics = RequestMetrics(arrival_time=time.perf_counter(), num_prompt_tokens=len(prompt_ids))
            seed = draw_seed(params.seed)
            tracked = TrackedRequest(request, params, metrics, detok, inbox, index,
                                     core.new_state(params, seed, request, grammar),
                                     RequestGroup(request_id, params.n, retain_kv))
            tracked.kv_prefix = kv_prefix
            if resume and detok is not None:
                tracked.pending_text = resume_text
            tracked.images = images or None
            core.register(tracked)
        return tracked

    def compile_grammar(self, params: SamplingParams | None):
        """Start compiling the request's `structured` constraint (`Grammars.submit`): a
        `structured.grammar.Compiling` to wait for, whose grammar `track` then takes; None without one.

        Raises:
            ValueError/TypeError: malformed params; a constraint refused at once (it ran past the time
                limit before, or too many compiles are queued); no tokenizer.
            ImportError: naming the extra, without xgrammar.
        """
        if not isinstance(params, SamplingParams) or params.structured is None:
            return None
        params.validate(self.vocab_size)
        return self._grammars().submit(params.structured)

    def _grammar(self, params: SamplingParams, compiled=None):
        """A fresh matcher of the request's `structured` constraint (its `compiled` grammar, or compiled
        here: once per distinct one, waiting at most the time limit), or None. Raises ValueError when it
        does not compile (in time), ImportError naming the extra without xgrammar."""
        if params.structured is None:
            return None
        return self._grammars().state(params.structured, compiled)

    def _grammars(self):
        if self.tokenizer is None:
            raise ValueError("structured outputs need a tokenizer: pass tokenizer= to the Engine")
        with self._grammars_lock:
            if self.grammars is None:
                from ..structured.grammar import Grammars  # the `structured` extra
                self.grammars = Grammars(self.tokenizer, self.logits_width, self.core.eos_token_ids,
                                         **self.grammar_limits)
        return self.grammars

    def _split_prompt(self, prompt) -> tuple:
        """(text or ids, [ImageItem]) of a prompt: a dict `{"prompt" or "prompt_token_ids", "multi_modal_data"}`
        (vLLM's form; `multi_modal_data` is the processor's image tensors for this prompt), or a plain one."""
        if not isinstance(prompt, dict):
            return prompt, []
        unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"})
        if unknown:
            raise ValueError(f"a prompt dict takes 'prompt' or 'prompt_token_ids' and 'multi_modal_data', got {unknown}")
        if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise ValueError("a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids'")
        text = prompt["prompt"] if "prompt" in prompt else prompt["prompt_token_ids"]
        data = prompt.get("multi_modal_data")
        if data is None:
            return text, []
        if self.images is None:
            raise ValueError("this engine takes no multi_modal_data")
        items = self.images.split(data)
        if not items:
            raise ValueError("multi_modal_data holds no image")
        return text, items
