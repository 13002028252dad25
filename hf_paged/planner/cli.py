"""`hf-paged kv-size | roofline | plan`: the sizing calculus of `hf_paged.planner.sizing` on the command line.

Every subcommand takes a model: a `config.json` path, a model directory, or a bundled reference name
(see `hf_paged.planner.sizing.reference_config_names()`). Tables go to stdout; `--json` prints one JSON object
instead. Bad input prints one line to stderr and returns exit status 2. The output depends on the
arguments alone (no clock, no machine), so the docs can show it verbatim.

A model hf_paged cannot serve yet (`refusals.refusal`) gets a `note:` line saying why (JSON: `refusal`);
`plan` for weights that do not fit one device plans the smallest tensor-parallel split that does.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..config import DEFAULT_BLOCK_SIZE
from . import sizing
from .layers import KNOWN_KINDS, STATE_KINDS
from .refusals import refusal
from .sizing import GB, GiB

# What the plan calls the sequences gained by the groups that free blocks, by their layer kinds.
_GAIN_LABELS = {("sliding_attention",): "sliding-window gain", ("chunked_attention",): "chunked-attention gain"}
_PLOT_SIZE = (8.0, 5.0)  # inches; at _PLOT_DPI the PNG is 800 x 500 pixels
_PLOT_DPI = 100


def add_subcommands(subparsers) -> None:
    """Register kv-size, roofline and plan on an `argparse` subparsers object."""
    names = ", ".join(sizing.reference_config_names())
    model_help = f"config.json, model directory, or a bundled config: {names}"

    kv = subparsers.add_parser("kv-size", help="KV-cache bytes per token, per sequence and in total")
    kv.add_argument("model", help=model_help)
    kv.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (default 4096)")
    kv.add_argument("--batch", type=int, default=1, help="number of sequences (default 1)")
    kv.add_argument("--kv-dtype", default="bfloat16",
                    help=f"KV cache dtype: {', '.join(sizing.DTYPE_NAMES)} (default bfloat16; fp8/int8 bytes include their scales)")
    kv.add_argument("--kv-heads", type=int, default=None, help="override the number of KV heads (what-if)")
    kv.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel ranks: the figures are one rank's (its share of the KV heads; a latent "
                         "layer keeps its whole row on every rank; default 1)")
    kv.add_argument("--compare", action="store_true", help="MHA vs GQA vs MQA (vs MLA) vs fp8, side by side")
    kv.add_argument("--state-checkpoints", type=int, default=None, metavar="N",
                    help="recurrent models (Mamba, linear attention): prefix-cache state checkpoints counted in the "
                         "total, each one sequence's state (default: the engine's default for --batch running "
                         "sequences, one per sequence)")
    kv.add_argument("--plot", metavar="PNG", help="draw KV GB against context length per attention variant")
    kv.add_argument("--json", action="store_true", help="print JSON instead of a table")
    kv.set_defaults(sizing_handler=run_kv_size)

    roof = subparsers.add_parser("roofline", help="decode arithmetic intensity against a GPU's roofline")
    roof.add_argument("model", help=model_help)
    roof.add_argument("--gpu", default=None,
                      help=f"preset: {', '.join(sizing.GPU_PRESETS)} (default h100-sxm unless --tflops and "
                           "--bandwidth are both given)")
    roof.add_argument("--tflops", type=float, default=None, help="peak dense TFLOPS (overrides the preset)")
    roof.add_argument("--bandwidth", type=float, default=None, help="memory bandwidth in TB/s (overrides the preset)")
    roof.add_argument("--seq-len", type=int, default=1024, help="cached tokens per sequence (default 1024)")
    roof.add_argument("--batch", type=int, nargs="+", default=None,
                      help=f"batch sizes to tabulate (default {' '.join(map(str, sizing.DEFAULT_BATCH_SIZES))})")
    roof.add_argument("--weight-dtype", default="bfloat16",
                      help="weight dtype (default bfloat16)")
    roof.add_argument("--kv-dtype", default="bfloat16",
                      help="KV cache dtype (default bfloat16)")
    roof.add_argument("--plot", metavar="PNG", help="draw the roofline with the decode points marked")
    roof.add_argument("--json", action="store_true", help="print JSON instead of a table")
    roof.set_defaults(sizing_handler=run_roofline)

    pl = subparsers.add_parser("plan", help="weights, KV blocks and concurrent sequences that fit one GPU")
    pl.add_argument("model", help=model_help)
    pl.add_argument("--gpu", default=None, help=f"preset giving the memory size: {', '.join(sizing.GPU_PRESETS)}")
    pl.add_argument("--memory-gb", type=float, default=None, help="GPU memory in GB (10^9 bytes)")
    pl.add_argument("--utilization", type=float, default=0.9, help="fraction of memory to use (default 0.9)")
    pl.add_argument("--kv-budget", type=int, default=None,
                    help="KV budget in bytes, instead of memory * utilization - weights")
    pl.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (default 4096)")
    pl.add_argument("--max-seq-len", type=int, default=None,
                    help="contiguous allocation length (default: the config's max_position_embeddings)")
    pl.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                    help=f"tokens per KV block (default {DEFAULT_BLOCK_SIZE})")
    pl.add_argument("--weight-dtype", default="bfloat16",
                      help="weight dtype (default bfloat16)")
    pl.add_argument("--kv-dtype", default="bfloat16",
                      help="KV cache dtype (default bfloat16)")
    pl.add_argument("--step-tokens", type=int, default=1,
                    help="tokens the step reaching seq-len writes: 1 while decoding (default), a prefill chunk "
                         "while prefilling; a sliding-window (chunked) layer holds its window (chunk) plus these")
    pl.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel ranks: plan one device's share (its weights and KV heads; default 1)")
    pl.add_argument("--state-checkpoints", type=int, default=None, metavar="N",
                    help="recurrent models (Mamba, linear attention): prefix-cache state checkpoints (the engine's "
                         "--max-state-checkpoints), each one sequence's state, taken from the budget before "
                         "sequences are fitted (default: the engine's default, one per sequence that fits)")
    pl.add_argument("--json", action="store_true", help="print JSON instead of a table")
    pl.set_defaults(sizing_handler=run_plan)


def run(args: argparse.Namespace) -> int:
    """Run the handler of a parsed sizing subcommand; bad input becomes one stderr line and status 2."""
    try:
        return args.sizing_handler(args)
    except (ValueError, OSError, ImportError) as e:
        print(f"hf-paged {args.command}: error: {e}", file=sys.stderr)
        return 2


# ---------------------------------------------------------------------------------------------- handlers
def _load(args) -> tuple[sizing.ModelShape, list[str], str | None]:
    """The model's shape, the notes its figures need, and why hf_paged cannot serve it (or None)."""
    config = sizing.load_config(args.model)
    shape = sizing.ModelShape.from_config(config, name=args.model)
    why = refusal(config)
    notes = [f"hf_paged cannot serve this model yet: {why}; the figures are what its cache would take"] if why else []
    unknown = sorted({k for k in shape.layer_kinds if k not in KNOWN_KINDS})
    if unknown:
        notes.append(f"{', '.join(unknown)} layers are counted as full attention (every token's K/V)")
    if shape.num_unsized_state_layers:
        notes.append(f"the state of {shape.num_unsized_state_layers} layers ({shape.model_type}) is not counted: "
                     "the planner does not know its size")
    return shape, notes, why


def _print_notes(notes: list[str]) -> None:
    for note in notes:
        print(f"note: {note}")


def run_kv_size(args) -> int:
    shape, notes, why = _load(args)
    if args.kv_heads is not None:
        shape = shape.with_kv_heads(args.kv_heads)
    kind = shape.attention_kind  # the model's, not what one rank's share of the heads looks like
    shape = shape.per_rank(args.tp)
    sizing.dtype_bytes(args.kv_dtype)
    if args.seq_len < 1:
        raise ValueError(f"seq-len must be positive, got {args.seq_len}")
    if args.compare:
        rows = sizing.compare_kv(shape, args.seq_len, args.batch, args.kv_dtype, args.state_checkpoints)
    else:
        rows = [sizing.kv_size(shape, args.seq_len, args.batch, args.kv_dtype, variant=kind,
                               state_checkpoints=args.state_checkpoints)]
    if args.plot:
        plot_kv_vs_context(shape, args.plot, kv_dtype=args.kv_dtype, batch_size=args.batch, seq_len=args.seq_len)
    owning = [s for s in shape.kv_layer_specs if s.owns_kv]
    windows = sorted({s.mask.window for s in owning if s.mask.window})
    chunks = sorted({s.mask.chunk for s in owning if s.mask.chunk})
    num_shared = shape.num_kv_layers - len(owning)
    if args.json:
        _print_json({"model": shape.name, "layer_kinds": shape.layer_kind_counts, "sliding_windows": windows,
                     "attention_chunks": chunks, "num_shared_kv_layers": num_shared,
                     "state_bytes_per_seq": shape.state_bytes_per_seq,
                     "num_state_checkpoints": rows[0].num_state_checkpoints,
                     "state_checkpoint_bytes": rows[0].state_checkpoint_bytes, "refusal": why, "notes": notes,
                     "rows": [r.to_dict() for r in rows], "plot": args.plot})
        return 0
    _print_notes(notes)
    heads = f"{shape.num_attention_heads} heads, " if shape.num_kv_layers else ""
    print(f"{shape.name}: {_layers_desc(shape)}, {heads}{_kv_desc(shape)}, seq_len {args.seq_len:,}, "
          f"batch {args.batch:,}")
    if windows:
        print(f"sliding-window layers keep at most {', '.join(f'{w:,}' for w in windows)} tokens")
    if chunks:
        print(f"chunked-attention layers keep at most their chunk: {', '.join(f'{c:,}' for c in chunks)} tokens")
    if num_shared:
        print(f"{num_shared} layers reuse another layer's K/V and keep none of their own")
    if shape.state_bytes_per_seq:
        print(_state_desc(shape))
        print(_checkpoint_desc(rows[0]))
    native = rows[0].total_bytes if not args.compare else sizing.kv_size(
        shape, args.seq_len, args.batch, args.kv_dtype, state_checkpoints=args.state_checkpoints).total_bytes
    has_state = bool(shape.state_bytes_per_seq)
    headers = ["variant", "kv heads", "dtype", "bytes/token", "payload", "scales",
               *(["state/seq", "checkpoints"] * has_state), "per seq GB", "per seq GiB", "total GB", "total GiB",
               "vs model"]
    table = [[r.variant, r.num_kv_heads, r.kv_dtype, f"{r.bytes_per_token:,}",
              f"{r.bytes_per_token - r.scale_bytes_per_token:,}", f"{r.scale_bytes_per_token:,}",
              *([f"{r.state_bytes_per_seq:,}", f"{r.state_checkpoint_bytes:,}"] * has_state),
              f"{r.bytes_per_seq / GB:,.3f}",
              f"{r.bytes_per_seq / GiB:,.3f}", f"{r.total_gb:,.1f}", f"{r.total_gib:,.1f}",
              f"{r.total_bytes / native:.3g}x" if native else "-"] for r in rows]
    print(_table(headers, table))
    if args.plot:
        print(f"plot: {args.plot}")
    return 0


def _layers_desc(shape) -> str:
    """The layer count, with the count of each kind when some layer is not plain attention."""
    counts = shape.layer_kind_counts
    if set(counts) <= {"full_attention", "sliding_attention"}:
        return f"{shape.num_layers} layers"
    return f"{shape.num_layers} layers ({', '.join(f'{n} {kind}' for kind, n in counts.items())})"


def _state_desc(shape) -> str:
    kinds = [k for k in shape.layer_kind_counts if k in STATE_KINDS]
    parts = []
    if shape.recurrent_state_elements:
        dtype = shape.recurrent_state_dtype or shape.model_dtype
        parts.append(f"recurrent {shape.recurrent_state_elements:,} x {dtype}")
    if shape.conv_state_elements:
        parts.append(f"conv {shape.conv_state_elements:,} x {shape.model_dtype}")
    return (f"{' and '.join(kinds)} layers keep a fixed state per sequence instead of K/V per token: "
            f"{shape.state_bytes_per_seq:,} bytes ({'; '.join(parts)})")


def _checkpoint_desc(r) -> str:
    """The prefix cache's state checkpoints of a `KVSize` row: how many, and their bytes."""
    n = r.num_state_checkpoints
    return (f"prefix caching keeps {n:,} state checkpoint{'s' * (n != 1)} (--state-checkpoints; default one per "
            f"sequence of --batch) of that state: {r.state_checkpoint_bytes:,} bytes, "
            f"{_gb(r.state_checkpoint_bytes)}, counted in the total")


def _kv_desc(shape) -> str:
    if not shape.num_kv_layers:
        return "no attention (no K/V)"
    if shape.latent_specs:
        return _latent_desc(shape)
    desc = f"{shape.num_kv_heads} KV heads x head_dim {shape.head_dim} ({shape.attention_kind})"
    others = {}  # per-layer shapes (Gemma 4's full layers): the layers whose K/V differ from the config's
    for s in shape.kv_layer_specs:
        if s.owns_kv and (s.shape.num_kv_heads, s.shape.head_dim) != (shape.num_kv_heads, shape.head_dim):
            others.setdefault(f"{s.kind} layers {s.shape.num_kv_heads} KV heads x head_dim {s.shape.head_dim}", 0)
    return ", ".join([desc, *others])


def _latent_desc(shape) -> str:
    """A latent-attention model's row per token and layer, from its specs (`kv_spec.LatentAttention`),
    e.g. "MLA latent 512 + rope 64 + indexer 128 (704 per token and layer; indexed: ...)"."""
    specs = shape.latent_specs
    first, indexed = specs[0], [s for s in specs if s.index_dim]
    desc = f"MLA latent {first.shape.head_dim} + rope {first.shape.head_dim_v}"
    if indexed:
        desc += f" + indexer {indexed[0].index_dim}"
        if len(indexed) < len(specs):
            desc += f" in {len(indexed)} of {len(specs)} layers"
    widths = {s.row_width for s in specs}
    notes = [f"{widths.pop():,} per token and layer"] if len(widths) == 1 else []
    if indexed:
        notes.append(f"indexed: attention reads the top {indexed[0].index_topk:,} keys per query, "
                     f"{shape.index_n_heads} indexer heads score every key")
    return f"{desc} ({'; '.join(notes)})" if notes else desc


def run_roofline(args) -> int:
    shape, notes, why = _load(args)
    gpu_name = args.gpu or (None if args.tflops is not None and args.bandwidth is not None else "h100-sxm")
    gpu = sizing.get_gpu(gpu_name, args.tflops, args.bandwidth)
    sizing.dtype_bytes(args.weight_dtype)
    sizing.dtype_bytes(args.kv_dtype)
    batches = args.batch or sizing.DEFAULT_BATCH_SIZES
    for b in batches:
        if b < 1:
            raise ValueError(f"batch must be positive, got {b}")
    if args.seq_len < 0:
        raise ValueError(f"seq-len must be non-negative, got {args.seq_len}")
    report = sizing.roofline(shape, gpu, seq_len=args.seq_len, batch_sizes=batches,
                             weight_dtype=args.weight_dtype, kv_dtype=args.kv_dtype)
    if args.plot:
        plot_roofline(report, args.plot)
    if args.json:
        _print_json({**report.to_dict(), "refusal": why, "notes": notes, "plot": args.plot})
        return 0
    _print_notes(notes)
    bound = (f"batch {report.compute_bound_batch:,}" if report.compute_bound_batch is not None else
             f"never (intensity tends to {report.asymptotic_intensity:.1f} FLOPs/byte, KV reads dominate)")
    print(f"{shape.name} on {gpu.name}: {gpu.tflops:g} TFLOPS, {gpu.bandwidth_tbs:g} TB/s; weights "
          f"{args.weight_dtype}, KV {args.kv_dtype}, context {args.seq_len:,} tokens")
    print(f"ridge point: {report.ridge_point:.1f} FLOPs/byte")
    print(f"decode turns compute-bound at: {bound}")
    print(f"bandwidth-bound time per token (batch 1): >= {report.min_time_per_token_s * 1e3:.3f} ms "
          f"(<= {1 / report.min_time_per_token_s:,.1f} tokens/s)")
    headers = ["batch", "GFLOPs/step", "GB read/step", "FLOPs/byte", "bound", "step ms >=", "tokens/s <="]
    table = [[f"{p.batch_size:,}", f"{p.flops / 1e9:,.1f}", f"{p.bytes / GB:,.2f}", f"{p.intensity:,.2f}",
              "compute" if p.is_compute_bound else "memory", f"{p.step_time_s * 1e3:,.3f}",
              f"{p.tokens_per_s:,.0f}"] for p in report.points]
    print(_table(headers, table))
    if args.plot:
        print(f"plot: {args.plot}")
    return 0


def run_plan(args) -> int:
    model, notes, why = _load(args)
    memory_gb = args.memory_gb
    if memory_gb is None and args.gpu:
        memory_gb = sizing.get_gpu(args.gpu).memory_gb
    if memory_gb is not None and memory_gb <= 0:
        raise ValueError(f"memory-gb must be positive, got {memory_gb}")
    if memory_gb is None and args.kv_budget is None:
        memory_gb = sizing.GPU_PRESETS["h100-sxm"].memory_gb
    memory = int(memory_gb * GB) if memory_gb else None
    kwargs = dict(seq_len=args.seq_len, block_size=args.block_size, max_seq_len=args.max_seq_len,
                  weight_dtype=args.weight_dtype, kv_dtype=args.kv_dtype, step_tokens=args.step_tokens,
                  state_checkpoints=args.state_checkpoints)
    tp, options = args.tp, []
    try:
        result = sizing.plan(model.per_rank(tp), memory_bytes=memory, utilization=args.utilization,
                             kv_budget_bytes=args.kv_budget, **kwargs)
    except sizing.WeightsDoNotFit as e:
        options = sizing.tp_options(model, memory_bytes=memory, utilization=args.utilization, above=tp, **kwargs)
        fit = sizing.smallest_fit(options)
        if fit is None:
            raise ValueError(f"{e}, {_no_split(model, options)}") from None
        tp = fit.tensor_parallel_size
        result = sizing.plan(model.per_rank(tp), memory_bytes=memory, utilization=args.utilization, **kwargs)
        notes.append(f"{e} of one device; the smallest tensor-parallel split that holds a sequence of "
                     f"{args.seq_len:,} tokens is --tp {tp}, planned below")
    else:
        if not result.num_seqs_paged and memory:
            options = sizing.tp_options(model, memory_bytes=memory, utilization=args.utilization, above=tp, **kwargs)
            fit = sizing.smallest_fit(options)
            if fit is not None:
                notes.append(f"no sequence of {args.seq_len:,} tokens fits one device; --tp "
                             f"{fit.tensor_parallel_size} holds {fit.num_seqs_paged:,}")
    shape = model.per_rank(tp)  # every figure below is one device's
    if result.num_state_checkpoints and not result.num_seqs_paged:
        notes.append(f"the {result.num_state_checkpoints:,} state checkpoints ({_gb(result.state_checkpoint_bytes)}) "
                     "leave no room for a sequence: lower --state-checkpoints")
    if args.json:
        _print_json({**result.to_dict(), "tensor_parallel_size": tp, "refusal": why, "notes": notes,
                     "tp_options": [o.to_dict() for o in options]})
        return 0
    _print_notes(notes)
    if options and tp != args.tp:
        print(f"tensor-parallel splits (figures per device, sequences of {args.seq_len:,} tokens)")
        print(_table(["tp", "weights", "KV budget", "sequences"],
                     [[o.tensor_parallel_size, _gb(o.weight_bytes), _gb(max(o.kv_budget_bytes, 0)),
                       f"{o.num_seqs_paged:,}"] for o in options]))
    r = result
    gain = f"{r.num_seqs_paged / r.num_seqs_contiguous:.1f}x" if r.num_seqs_contiguous else "-"
    rows = [
        *([["tensor-parallel ranks (figures per device)", f"{tp}"]] if tp > 1 else []),
        ["GPU memory", _gb(r.memory_bytes) if r.memory_bytes else "-"],
        ["utilization", f"{r.utilization:g}" if r.memory_bytes else "-"],
        [f"weights ({args.weight_dtype}, {shape.num_params / 1e9:,.2f}B params)", _gb(r.weight_bytes)],
        [f"KV budget ({args.kv_dtype})", _gb(r.kv_budget_bytes)],
        *([["fixed state per sequence (bytes)", f"{r.state_bytes_per_seq:,}"],
           [f"prefix-cache state checkpoints ({r.num_state_checkpoints:,} x that state)",
            _gb(r.state_checkpoint_bytes)]] if r.state_bytes_per_seq else []),
        [f"bytes per block ({r.block_size} tokens)", f"{r.bytes_per_block:,}"],
        ["KV blocks", f"{r.num_blocks:,}"],
        [f"blocks per sequence of {r.seq_len:,} tokens ({r.num_kv_groups} KV group"
         f"{'s' if r.num_kv_groups != 1 else ''}, step of {r.step_tokens})", f"{r.blocks_per_seq:,}"],
        [f"sequences of {r.seq_len:,} tokens, paged", f"{r.num_seqs_paged:,}"],
        [f"sequences, contiguous at max length {r.max_seq_len:,}", f"{r.num_seqs_contiguous:,}"],
        ["paging gain", gain],
        *([["sequences if every layer kept every token", f"{r.num_seqs_without_hybrid:,}"],
           [_GAIN_LABELS.get(r.freeing_kinds, "local-attention gain"),
            f"{r.num_seqs_paged / r.num_seqs_without_hybrid:.2f}x" if r.num_seqs_without_hybrid else "-"]]
          if r.freeing_kinds else []),
        ["contiguous waste", f"{_gb(r.contiguous_waste_bytes)} ({r.contiguous_waste_fraction:.1%} of each allocation)"],
        ["paged waste (partial blocks)", _gb(r.paged_waste_bytes)],
    ]
    print(f"plan for {shape.name}")
    print(_table(["quantity", "value"], rows))
    return 0


def _no_split(model: sizing.ModelShape, options: list) -> str:
    """Why no tensor-parallel split rescues a model whose weights do not fit one device."""
    if not options:
        return (f"and no larger power-of-two split divides its {model.num_attention_heads} attention and "
                f"{model.num_kv_heads} KV heads")
    experts = ("; its routed experts stay whole on every tensor-parallel rank (transformers splits them over "
               "devices under expert parallelism, its ep_size, which this planner does not plan)"
               if model.num_moe_layers else "")
    return (f"nor does one device's share under --tp {options[-1].tensor_parallel_size}, the largest split its "
            f"{model.num_attention_heads} attention and {model.num_kv_heads} KV heads allow{experts}")


# ---------------------------------------------------------------------------------------------- plots
def _figure():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install 'hf_paged[plot]'") from None
    fig = Figure(figsize=_PLOT_SIZE, dpi=_PLOT_DPI)  # no pyplot: no global state, no display backend
    FigureCanvasAgg(fig)
    return fig


def plot_kv_vs_context(shape: sizing.ModelShape, path: str, *, kv_dtype: str = "bfloat16", batch_size: int = 1,
                       seq_len: int | None = None, max_context: int | None = None) -> None:
    """PNG of KV GB against context length (log x) for each attention variant of `shape`."""
    top = max(max_context or 0, shape.max_position_embeddings or 0, seq_len or 0, 1024)
    contexts = sorted({int(round(2 ** (i / 4))) for i in range(4 * 7, 4 * (top.bit_length() + 1))} | {top})
    contexts = [c for c in contexts if c <= top]
    fig = _figure()
    ax = fig.add_subplot()
    for label, variant, dtype in sizing.attention_variants(shape, kv_dtype):
        gbs = [sizing.kv_bytes(variant, c, batch_size, dtype) / GB for c in contexts]
        ax.plot(contexts, gbs, label=label if dtype in label else f"{label} ({dtype})")
    if seq_len:
        ax.axvline(seq_len, color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(f"KV cache, GB (batch {batch_size})")
    ax.set_title(f"{shape.name}: KV cache size by attention variant")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png")


def plot_roofline(report: sizing.Roofline, path: str) -> None:
    """PNG of the roofline (attainable TFLOPS against FLOPs/byte, log-log) with the decode points."""
    gpu = report.gpu
    intensities = [p.intensity for p in report.points]
    lo = min(min(intensities), 1.0) / 2
    hi = max(max(intensities), report.ridge_point) * 4
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    fig = _figure()
    ax = fig.add_subplot()
    ax.plot(xs, [min(gpu.tflops, x * gpu.bandwidth_tbs) for x in xs], color="black", label=f"{gpu.name} roofline")
    ax.axvline(report.ridge_point, color="grey", linestyle=":", linewidth=1,
               label=f"ridge {report.ridge_point:.0f} FLOPs/byte")
    attained = [min(gpu.tflops, p.intensity * gpu.bandwidth_tbs) for p in report.points]
    ax.scatter(intensities, attained, color="tab:red", zorder=3, label=f"decode, context {report.seq_len:,}")
    for p, y in zip(report.points, attained):
        ax.annotate(f"B={p.batch_size}", (p.intensity, y), textcoords="offset points", xytext=(4, -10), fontsize=7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOPs/byte)")
    ax.set_ylabel("attainable TFLOPS")
    ax.set_title(f"{report.model} decode on {gpu.name} (weights {report.weight_dtype}, KV {report.kv_dtype})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, format="png")


# ---------------------------------------------------------------------------------------------- formatting
def _gb(n: float) -> str:
    return f"{n / GB:,.2f} GB ({n / GiB:,.2f} GiB)"


def _table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row):  # first column left-aligned (labels), numbers right-aligned
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]])


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2, default=lambda o: None if o != o else str(o)))
