"""Sampler micro-benchmark: the batched `hf_paged.worker.sampler.Sampler` against the per-row loop
it replaced (`sample` of hf_paged/worker/sampling.py at 67c28e0, copied below as the baseline), on
the same logits and the same token histories, in the same run.

Scenarios (default 64 rows; vocabularies 49,152 (SmolLM2) and 151,936 (Qwen2)):
  * mixed: per-row settings from a mix (`MIXED`): greedy, greedy + repetition penalty,
    temperature + top-k + top-p, temperature only (full vocabulary), top-p only, min-p,
    presence/frequency penalties, min_new_tokens active, logit_bias, no_repeat_ngram_size, bad words.
    The baseline supports only temperature, top_k, top_p, repetition_penalty and min_new_tokens; a row
    with other settings runs the baseline with the supported subset (printed), so on those rows the
    baseline does less work than the batched sampler.
  * sampling: every row temperature=0.8, top_p=0.95, top_k=50, repetition_penalty=1.1.
  * greedy: every row plain greedy.

Decoding is simulated: every row starts with a history of a few hundred tokens (prompt + outputs);
each step both implementations get their own copy of the same fresh logits (cloned before the timer
starts: the batched sampler overwrites its input), then one token is appended to every row's history
(the batched sampler's token, the same list for both), so the batched sampler's incremental penalty
and n-gram state absorbs one token per step, as in the engine. The first `--warmup` steps (which also
absorb the initial histories) are not timed. Each call is timed alone with time.perf_counter; the
timed region includes building each step's per-row state objects (the old engine built a
SamplingState per request per step; the new one builds a SampleRow), not the logits copy. The two
run in alternating order from step to step. Printed per scenario and vocabulary: the median (and
min) ms/step of each, and loop / batched. CPU only; the load average is printed at the start and
the end, since other processes on the machine inflate both timings.

Logits: `--logits peaked` (default) puts a decaying head of 256 random tokens (height and slope drawn
per row) over N(0, 1) noise, so some rows are near-deterministic and some spread; the printed
"top-1024 mass" says how peaked they came out (it decides whether the batched sampler's top-p-only
rows take its top-1024 shortcut or a full sort). `--logits flat` is N(0, 1) everywhere (every top-p
row sorts its whole vocabulary).

Checks, informational: every token is inside the vocabulary and not masked (an end token before
min_new_tokens, an n-gram / bad-word ban; on the last step, the token has a finite logit in each
implementation's own processed distribution), and greedy rows whose settings the baseline supports in
full pick identical tokens in both. Sampled rows are not compared: the baseline draws with Gumbel
noise, the batched sampler by inverse CDF, so their random tokens differ by design.

    python benchmarks/sampler.py [--rows 64] [--vocab 49152 151936] [--steps 15] [--warmup 3]
                                 [--threads N] [--logits peaked|flat] [--scenarios mixed,sampling,greedy]
    python benchmarks/sampler.py --quick      # 5 timed steps after 1 warm-up
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time
from dataclasses import dataclass

import torch

from hf_paged.worker.sampler import Sampler, SampleRow, processed_logits
from hf_paged.sampling_params import SamplingParams
from hf_paged.worker.sampling import SamplingState


# ====================================================================== baseline: the per-row loop
# A copy of hf_paged/worker/sampling.py at 67c28e0 (`sample` and what it calls), renamed with an
# `old_` / `Old` prefix so it can sit beside the new module; the bodies are unchanged.
@dataclass
class OldSamplingParams:
    """The fields of the old SamplingParams that its sampler read."""

    max_new_tokens: int = 16
    min_new_tokens: int = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class OldSamplingState:
    params: OldSamplingParams
    seed: int
    token_ids: list[int]  # prompt + outputs, for the repetition penalty
    num_output_tokens: int
    end_token_ids: list[int]  # eos (unless ignore_eos) + stop_token_ids, masked before min_new_tokens

    @property
    def position(self) -> int:
        return len(self.token_ids)


_MASK64 = (1 << 64) - 1


def _as_int64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _as_int64(0x9E3779B97F4A7C15)
_MIX1 = _as_int64(0xBF58476D1CE4E5B9)
_MIX2 = _as_int64(0x94D049BB133111EB)


def _old_noise_key(seed: int, position: int) -> int:
    x = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return _as_int64(x ^ (x >> 31))


def _old_mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _MIX1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _MIX2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def old_token_noise(seed: int, position: int, token_ids: torch.Tensor) -> torch.Tensor:
    x = _old_mix(token_ids.to(torch.int64) * _GOLDEN + _old_noise_key(seed, position))
    u = ((x >> 11) & ((1 << 53) - 1)).to(torch.float64) * 2.0**-53  # uniform on [0, 1)
    exponential = -torch.log1p(-u)
    return (-torch.log(exponential.clamp_min(1e-300))).float()


def old_sample_processed(processed: torch.Tensor, state: OldSamplingState) -> int:
    if state.params.is_greedy:
        return int(processed.argmax())
    allowed = (processed > float("-inf")).nonzero().flatten()
    scores = processed[allowed] + old_token_noise(state.seed, state.position, allowed)
    return int(allowed[scores.argmax()])


def old_sample(logits: torch.Tensor, states: list[OldSamplingState]) -> list[int]:
    logits = logits.float()
    out: list[int | None] = [None] * len(states)
    plain = [i for i, s in enumerate(states) if s.params.is_greedy and not old_needs_processing(s)]
    if plain:
        for i, tok in zip(plain, logits[plain].argmax(dim=-1).tolist()):
            out[i] = tok
    for i, state in enumerate(states):
        if out[i] is None:
            out[i] = _old_sample_row(logits[i], state)
    return out  # type: ignore[return-value]


def old_needs_processing(state: OldSamplingState) -> bool:
    p = state.params
    return p.repetition_penalty != 1.0 or (state.num_output_tokens < p.min_new_tokens and bool(state.end_token_ids))


def old_processed_support(row: torch.Tensor, state: OldSamplingState) -> tuple[torch.Tensor | None, torch.Tensor]:
    p = state.params
    penalise = p.repetition_penalty != 1.0 and bool(state.token_ids)
    mask_end = state.num_output_tokens < p.min_new_tokens and bool(state.end_token_ids)
    row = row.float().clone() if penalise or mask_end else row.float()  # never write into the logits
    if penalise:
        ids = torch.tensor(sorted(set(state.token_ids)), device=row.device)
        score = row[ids]
        row[ids] = torch.where(score < 0, score * p.repetition_penalty, score / p.repetition_penalty)
    if mask_end:
        row[torch.tensor(state.end_token_ids, device=row.device)] = float("-inf")
    if p.is_greedy:
        return None, row
    row = row / p.temperature
    token_ids = None
    if p.top_k and p.top_k < row.shape[-1]:
        kth = torch.topk(row, p.top_k).values[-1]
        token_ids = (row >= kth).nonzero().flatten()
        row = row[token_ids]
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        keep = cum > (1 - p.top_p)
        keep[-1] = True  # always keep the most likely token
        kept = order[keep]
        token_ids = kept if token_ids is None else token_ids[kept]
        row = sorted_logits[keep]
    return token_ids, row


def old_processed_logits(row: torch.Tensor, state: OldSamplingState) -> torch.Tensor:
    token_ids, logits = old_processed_support(row, state)
    if token_ids is None:
        return logits if logits.data_ptr() != row.data_ptr() else logits.clone()
    out = torch.full(row.shape, float("-inf"), device=row.device)
    out[token_ids] = logits
    return out


def _old_sample_row(row: torch.Tensor, state: OldSamplingState) -> int:
    token_ids, logits = old_processed_support(row, state)
    if state.params.is_greedy:
        return int(logits.argmax())
    if token_ids is None:
        return old_sample_processed(logits, state)
    return int(token_ids[(logits + old_token_noise(state.seed, state.position, token_ids)).argmax()])


# ====================================================================== workload
UNSUPPORTED = ("min_p", "presence_penalty", "frequency_penalty", "logit_bias", "bad_words_ids", "no_repeat_ngram_size")


def baseline_params(p: SamplingParams) -> OldSamplingParams:
    """The closest setting the per-row loop supports: `p` without what it never had."""
    return OldSamplingParams(max_new_tokens=p.max_new_tokens, min_new_tokens=p.min_new_tokens,
                             temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                             repetition_penalty=p.repetition_penalty)


def dropped(p: SamplingParams) -> list[str]:
    default = SamplingParams()
    return [name for name in UNSUPPORTED if getattr(p, name) != getattr(default, name)]


MAX_NEW = 4096


def _p(**kw):
    return lambda vocab, rng: SamplingParams(max_new_tokens=MAX_NEW, **kw)


def _bias(vocab, rng):
    ids = rng.sample(range(3, vocab), 8)
    return SamplingParams(max_new_tokens=MAX_NEW, logit_bias={t: (5.0 if j % 2 else -5.0) for j, t in enumerate(ids)})


def _bad_words(vocab, rng):
    words = [[rng.randrange(3, vocab)] for _ in range(4)] + [[rng.randrange(3, vocab), rng.randrange(3, vocab)]
                                                            for _ in range(4)]
    return SamplingParams(max_new_tokens=MAX_NEW, repetition_penalty=1.1, bad_words_ids=words)


# (name, rows out of 64, params). Scaled to --rows by proportion.
MIXED = [
    ("greedy", 8, _p()),
    ("greedy rep=1.2", 6, _p(repetition_penalty=1.2)),
    ("T=0.7 k=50 p=0.9", 8, _p(temperature=0.7, top_k=50, top_p=0.9)),
    ("T=1.0 (full vocab)", 6, _p(temperature=1.0)),
    ("top_p=0.9 only", 6, _p(temperature=1.0, top_p=0.9)),
    ("T=0.9 min_p=0.05", 4, _p(temperature=0.9, min_p=0.05)),
    ("T=0.8 p=0.95 k=50 rep=1.1", 6, _p(temperature=0.8, top_p=0.95, top_k=50, repetition_penalty=1.1)),
    ("T=0.8 p=0.95 pres=0.5 freq=0.3", 4, _p(temperature=0.8, top_p=0.95, presence_penalty=0.5,
                                              frequency_penalty=0.3)),
    ("T=0.7 k=40 min_new active", 4, _p(temperature=0.7, top_k=40, min_new_tokens=MAX_NEW // 2)),
    ("greedy logit_bias(8 ids)", 4, _bias),
    ("T=0.7 k=50 no_repeat_ngram=3", 4, _p(temperature=0.7, top_k=50, no_repeat_ngram_size=3)),
    ("greedy rep=1.1 bad_words(8)", 4, _bad_words),
]
SCENARIOS = {
    "mixed": MIXED,
    "sampling": [("T=0.8 p=0.95 k=50 rep=1.1", 64, _p(temperature=0.8, top_p=0.95, top_k=50,
                                                        repetition_penalty=1.1))],
    "greedy": [("greedy", 64, _p())],
}


def scaled(kinds, rows: int):
    """Kinds' counts scaled to `rows` rows (largest remainders), every kind kept when rows allow."""
    total = sum(c for _, c, _ in kinds)
    exact = [c * rows / total for _, c, _ in kinds]
    counts = [int(x) for x in exact]
    for j in sorted(range(len(kinds)), key=lambda j: exact[j] - counts[j], reverse=True)[: rows - sum(counts)]:
        counts[j] += 1
    return [(name, n, make) for (name, _, make), n in zip(kinds, counts) if n]


def history(vocab: int, rng: random.Random) -> tuple[list[int], int]:
    """Prompt (100-400 tokens) + outputs (20-200) with text-like repeats: 40% repeat an earlier token."""
    num_prompt, num_out = rng.randint(100, 400), rng.randint(20, 200)
    tokens = []
    for _ in range(num_prompt + num_out):
        tokens.append(tokens[rng.randrange(len(tokens))] if tokens and rng.random() < 0.4 else rng.randrange(3, vocab))
    return tokens, num_prompt


def make_logits(rows: int, vocab: int, step: int, mode: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 7919 + vocab)
    x = torch.randn(rows, vocab, generator=gen)
    if mode == "peaked":
        head = 256
        ids = torch.randint(0, vocab, (rows, head), generator=gen)
        height = 8 + 10 * torch.rand(rows, 1, generator=gen)  # top logit 8-18 above the noise
        slope = 0.05 + 0.95 * torch.rand(rows, 1, generator=gen)  # per rank
        x.scatter_add_(1, ids, (height - slope * torch.arange(head)).clamp_min(0))
    return x


END_IDS = [2, 0]  # eos and one stop token, masked on min_new_tokens rows


@dataclass
class Row:
    kind: str
    params: SamplingParams
    old_params: OldSamplingParams
    tokens: list[int]
    num_prompt: int
    seed: int
    state: SamplingState | None = None  # the batched sampler's, kept across steps


def build_rows(kinds, rows: int, vocab: int, seed: int) -> list[Row]:
    rng = random.Random(seed + vocab)
    out = []
    for name, n, make in scaled(kinds, rows):
        for _ in range(n):
            p = make(vocab, rng)
            p.validate(vocab)
            tokens, num_prompt = history(vocab, rng)
            s = 1000 + len(out)
            row = Row(name, p, baseline_params(p), tokens, num_prompt, s)
            row.state = SamplingState(p, s, tokens, num_prompt, END_IDS, END_IDS[:1])
            out.append(row)
    order = list(range(len(out)))
    rng.shuffle(order)  # kinds interleaved across the batch, as requests would be
    return [out[j] for j in order]


# ====================================================================== the run
def run_scenario(name, kinds, vocab: int, args, sampler: Sampler) -> dict:
    rows = build_rows(kinds, args.rows, vocab, args.seed)
    total = args.warmup + args.steps
    t_loop, t_batch = [], []
    agree = compared = 0
    invalid = {"loop": 0, "batched": 0}
    final_invalid = {"loop": 0, "batched": 0}
    head_mass = []
    for step in range(total):
        logits = make_logits(len(rows), vocab, step, args.logits, args.seed)
        a, b = logits.clone(), logits.clone()

        def loop():
            states = [OldSamplingState(r.old_params, r.seed, r.tokens, len(r.tokens) - r.num_prompt, END_IDS)
                      for r in rows]
            return old_sample(a, states)

        def batched():
            return sampler(b, [SampleRow(r.state) for r in rows]).token_ids

        timings = {}
        for which in (("loop", "batched") if step % 2 == 0 else ("batched", "loop")):  # alternate the order
            fn = loop if which == "loop" else batched
            start = time.perf_counter()
            tokens = fn()
            timings[which] = (time.perf_counter() - start, tokens)
        (dt_loop, tok_loop), (dt_batch, tok_batch) = timings["loop"], timings["batched"]
        if step >= args.warmup:
            t_loop.append(dt_loop)
            t_batch.append(dt_batch)
        if step == total - 1:
            probs = torch.softmax(logits, dim=-1)
            head_mass = probs.topk(min(1024, vocab), dim=-1).values.sum(dim=-1).tolist()
        for r, tl, tb, raw in zip(rows, tok_loop, tok_batch, logits):
            masked_end = set(END_IDS) if r.state.num_output_tokens < r.params.min_new_tokens else set()
            banned = set(r.state.banned_tokens()) if (r.params.bad_words_ids or r.params.no_repeat_ngram_size) else set()
            for which, t, bad in (("loop", tl, masked_end), ("batched", tb, masked_end | banned)):
                if not (0 <= t < vocab) or t in bad or not torch.isfinite(raw[t]):
                    invalid[which] += 1
            if step == total - 1:  # the token has a finite logit in the implementation's own distribution
                old_state = OldSamplingState(r.old_params, r.seed, r.tokens, len(r.tokens) - r.num_prompt, END_IDS)
                if not (0 <= tl < vocab) or old_processed_logits(raw, old_state)[tl] == float("-inf"):
                    final_invalid["loop"] += 1
                if not (0 <= tb < vocab) or processed_logits(raw, r.state)[tb] == float("-inf"):
                    final_invalid["batched"] += 1
            if r.params.is_greedy and not dropped(r.params):
                compared += 1
                agree += tl == tb
        for r, t in zip(rows, tok_batch):
            r.tokens.append(t)
    return {"rows": rows, "loop": statistics.median(t_loop) * 1e3, "batched": statistics.median(t_batch) * 1e3,
            "loop_min": min(t_loop) * 1e3, "batched_min": min(t_batch) * 1e3,
            "agree": agree, "compared": compared, "invalid": invalid, "final_invalid": final_invalid,
            "head_mass": head_mass}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 151936])
    parser.add_argument("--steps", type=int, default=None,
                        help="timed decoding steps per scenario and vocabulary (default 15; 5 with --quick)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps before them (default 3; 1 with --quick)")
    parser.add_argument("--quick", action="store_true", help="fewer steps: --steps 5 --warmup 1 unless given")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--logits", choices=("peaked", "flat"), default="peaked")
    parser.add_argument("--scenarios", default="mixed,sampling,greedy", help=f"comma list from {','.join(SCENARIOS)}")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.steps is None:
        args.steps = 5 if args.quick else 15
    if args.warmup is None:
        args.warmup = 1 if args.quick else 3
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if set(scenarios) - set(SCENARIOS) or not scenarios:
        parser.error(f"--scenarios: choose from {','.join(SCENARIOS)}")
    if args.steps < 1 or args.warmup < 0 or args.rows < 1:
        parser.error("need --steps >= 1, --warmup >= 0, --rows >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)

    print(f"env: torch={torch.__version__} python={platform.python_version()} torch threads={torch.get_num_threads()} "
          f"cpu count={os.cpu_count()} OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} "
          f"cpu={platform.processor() or platform.machine()} device=cpu")
    print(f"setup: rows={args.rows} vocab={args.vocab} steps={args.steps} timed after {args.warmup} warm-up, "
          f"logits={args.logits} fp32, histories 120-600 tokens (+1 per step), seed={args.seed}")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("loop = per-row `sample` of hf_paged/worker/sampling.py at 67c28e0 (copied into this file); "
          "batched = hf_paged.worker.sampler.Sampler")
    if "mixed" in scenarios:
        print(f"\nmixed rows (of {args.rows}); the loop runs the supported subset where settings are dropped:")
        for name, n, make in scaled(MIXED, args.rows):
            drop = dropped(make(1000, random.Random(0)))
            print(f"  {n:>3}  {name:34}{'loop drops: ' + ', '.join(drop) if drop else ''}")

    sampler = Sampler()
    results = []
    for scen in scenarios:
        for vocab in args.vocab:
            began = time.perf_counter()
            res = run_scenario(scen, SCENARIOS[scen], vocab, args, sampler)
            res.update(scenario=scen, vocab=vocab, wall=time.perf_counter() - began)
            results.append(res)
            mass = sorted(res["head_mass"])
            print(f"\n== {scen}, vocab {vocab}: {args.rows} rows, median of {args.steps} steps "
                  f"({res['wall']:.1f}s wall incl. checks)")
            print(f"{'':32}{'median':>10}{'min':>10}")
            print(f"{'per-row loop (ms/step)':32}{res['loop']:10.2f}{res['loop_min']:10.2f}")
            print(f"{'batched sampler (ms/step)':32}{res['batched']:10.2f}{res['batched_min']:10.2f}")
            print(f"{'speed-up (loop / batched)':32}{res['loop'] / res['batched']:10.2f}"
                  f"{res['loop_min'] / res['batched_min']:10.2f}")
            print(f"top-1024 mass of the raw logits (last step): min {mass[0]:.3f}, median "
                  f"{statistics.median(mass):.3f}, rows > 0.9: {sum(m > 0.9 for m in mass)}/{len(mass)}")
            print(f"invalid tokens (out of vocab, masked end token, banned, non-finite logit): loop "
                  f"{res['invalid']['loop']}, batched {res['invalid']['batched']} of {args.rows * (args.warmup + args.steps)}; "
                  f"last step outside own processed support: loop {res['final_invalid']['loop']}, "
                  f"batched {res['final_invalid']['batched']}")
            if res["compared"]:
                print(f"greedy agreement (rows whose settings the loop fully supports, all steps): "
                      f"{res['agree']}/{res['compared']}")
            else:
                print("greedy agreement: no greedy row with settings the loop fully supports")

    print(f"\nsummary (median ms/step over {args.steps} steps, {args.rows} rows, torch threads="
          f"{torch.get_num_threads()}; load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())})")
    print(f"{'scenario':12}{'vocab':>8}{'loop ms':>10}{'batched ms':>12}{'loop/batched':>14}")
    for res in results:
        print(f"{res['scenario']:12}{res['vocab']:>8}{res['loop']:10.2f}{res['batched']:12.2f}"
              f"{res['loop'] / res['batched']:14.2f}")


if __name__ == "__main__":
    main()
