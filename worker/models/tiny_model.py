"""Generate a tiny, seeded, random-weight Hugging Face causal LM directory (for tests and demos).

Rules:
- The output is a normal HF model dir: config.json, model.safetensors (float32), generation_config.json,
  tokenizer.json, tokenizer_config.json (with a ChatML ``chat_template``) and special_tokens_map.json.
- Everything is deterministic for a given (arguments, Python stdlib source): weights come from a
  ``torch.Generator`` seeded with ``seed``; the byte-level BPE tokenizer is trained on a fixed, sorted
  list of the standard library's ``.py`` files (capped at ~3 MB), so no download is ever needed.
- Special tokens always take ids 0..4: ``<s>`` (bos), ``</s>`` (eos), ``<|im_start|>``, ``<|im_end|>``,
  ``<pad>``. generation_config.json stops on both ``</s>`` and ``<|im_end|>``. No BOS is added on encode.
- ``len(tokenizer) == config.vocab_size`` exactly: a short trained vocab is padded with
  ``<|reserved_N|>`` special tokens, so the tokenizer never yields an id >= vocab_size.
- The dir is built in a temp dir next to ``out_dir`` and renamed into place, so a reader (or a racing
  writer) never sees a half-written dir. An existing ``out_dir`` raises FileExistsError unless
  ``overwrite=True`` (an empty existing dir is simply replaced).
- Heavy imports (torch, transformers, tokenizers) happen inside the functions, so importing this
  module for ``add_arguments`` is cheap. Nothing is printed; progress goes to ``logging``.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import shutil
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PretrainedConfig

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<s>", "</s>", "<|im_start|>", "<|im_end|>", "<pad>")
BOS_ID, EOS_ID, IM_START_ID, IM_END_ID, PAD_ID = range(len(SPECIAL_TOKENS))
ARCHS = ("llama", "qwen2", "mistral", "qwen3", "gemma2", "gemma3", "phi3")
# Logit std at init is about init_std * sqrt(hidden_size); 0.1 gives clearly separated greedy choices.
DEFAULT_INIT_STD = 0.1
CORPUS_MAX_CHARS = 3_000_000
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_SKIP_PARTS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "turtledemo", "__pycache__"}

# ChatML. `content` may be a string or a list of OpenAI-style parts (only "text" parts are rendered).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- elif message['content'] is not none -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def tiny_config(
    arch: str = "llama",
    *,
    hidden_size: int = 512,
    num_layers: int = 8,
    num_heads: int = 8,
    num_kv_heads: int = 4,
    intermediate_size: int = 1408,
    vocab_size: int = 8192,
    max_position_embeddings: int = 2048,
    init_std: float = DEFAULT_INIT_STD,
    sliding_window: int | None = None,
) -> PretrainedConfig:
    """Return the transformers config of ``arch`` for these sizes (qwen2: q/k/v bias, tied embeddings).

    ``sliding_window``: mistral and phi3 use it on every layer, gemma2/gemma3 on their alternate (sliding)
    layers (full attention on the rest), qwen2/qwen3 on every layer (``use_sliding_window``); llama ignores it.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if hidden_size % num_heads or num_heads % num_kv_heads or init_std <= 0:
        raise ValueError("need hidden_size % num_heads == 0, num_heads % num_kv_heads == 0, init_std > 0")
    common: dict[str, Any] = dict(
        hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size, vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings, initializer_range=init_std, rms_norm_eps=1e-6,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, dtype="float32",
    )
    return _ARCH_CONFIGS[arch](common, sliding_window)


def _llama(common: dict, window: int | None) -> PretrainedConfig:
    from transformers import LlamaConfig
    return LlamaConfig(**common, tie_word_embeddings=False)


def _mistral(common: dict, window: int | None) -> PretrainedConfig:
    from transformers import MistralConfig
    return MistralConfig(**common, tie_word_embeddings=False, sliding_window=window)


def _qwen(config_cls_name: str) -> Any:
    def build(common: dict, window: int | None) -> PretrainedConfig:
        import transformers
        head_dim = common["hidden_size"] // common["num_attention_heads"]  # Qwen3Config defaults to 128
        return getattr(transformers, config_cls_name)(
            **common, head_dim=head_dim, tie_word_embeddings=True, use_sliding_window=window is not None,
            sliding_window=window, max_window_layers=0)
    return build


def _gemma(config_cls_name: str) -> Any:
    """Alternating sliding/full layers (the first sliding), q scale from head_dim / 2, and a small
    attention softcap (Gemma 2) so that capping changes the scores of a tiny model."""
    def build(common: dict, window: int | None) -> PretrainedConfig:
        import transformers
        head_dim = common["hidden_size"] // common["num_attention_heads"]
        layers = common["num_hidden_layers"]
        extra: dict[str, Any] = {"rope_local_base_freq": 100.0} if config_cls_name == "Gemma3TextConfig" else {
            "attn_logit_softcapping": 5.0, "final_logit_softcapping": 30.0}
        return getattr(transformers, config_cls_name)(
            **common, head_dim=head_dim, query_pre_attn_scalar=head_dim // 2, tie_word_embeddings=True,
            hidden_activation="gelu_pytorch_tanh", sliding_window=window or common["max_position_embeddings"],
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
            **extra)
    return build


def _phi3(common: dict, window: int | None) -> PretrainedConfig:
    from transformers import Phi3Config
    return Phi3Config(**common, tie_word_embeddings=False, sliding_window=window,
                      original_max_position_embeddings=common["max_position_embeddings"])


_ARCH_CONFIGS = {"llama": _llama, "qwen2": _qwen("Qwen2Config"), "mistral": _mistral, "qwen3": _qwen("Qwen3Config"),
                 "gemma2": _gemma("Gemma2Config"), "gemma3": _gemma("Gemma3TextConfig"), "phi3": _phi3}


def _corpus(max_chars: int = CORPUS_MAX_CHARS) -> list[str]:
    """The stdlib's .py sources in sorted path order (tests, site-packages, build data skipped)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in root.rglob("*.py")
        if not _SKIP_PARTS.intersection(p.relative_to(root).parts) and not p.name.startswith("_sysconfigdata")
    )
    texts: list[str] = []
    total = 0
    for path in files:
        text = path.read_text("utf-8", errors="replace")
        texts.append(text[: max_chars - total])
        total += len(texts[-1])
        if total >= max_chars:
            break
    if not texts:
        raise RuntimeError(f"no Python sources found under {root} to train the tokenizer on")
    return texts


def build_tokenizer(vocab_size: int, arch: str = "llama") -> Tokenizer:
    """Train a byte-level BPE with exactly ``vocab_size`` ids (specials 0..4, reserved-token padding).

    llama: GPT-2 ByteLevel pre-tokenizer (lossless for any text). qwen2: NFC + Qwen2's split regex, i.e.
    exactly what transformers 5's ``Qwen2Tokenizer`` (which AutoTokenizer forces for qwen2) rebuilds.
    """
    import tokenizers as tk

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} (bytes + special tokens)")
    corpus = _corpus()
    return tk.Tokenizer.from_str(_trained_tokenizer_json(vocab_size, arch, tuple(corpus)))


@functools.lru_cache(maxsize=8)
def _trained_tokenizer_json(vocab_size: int, arch: str, corpus: tuple[str, ...]) -> str:
    """Training is the slow part of ``make_tiny_model``: one training per (size, flavor, corpus)."""
    import tokenizers as tk

    tok = tk.Tokenizer(tk.models.BPE())
    tok.decoder = tk.decoders.ByteLevel()
    if arch == "qwen2":
        tok.normalizer = tk.normalizers.NFC()
        tok.pre_tokenizer = tk.pre_tokenizers.Sequence([
            tk.pre_tokenizers.Split(tk.Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_special_tokens([tk.AddedToken(f"<|reserved_{i}|>", special=True) for i in range(missing)])
    if tok.get_vocab_size() != vocab_size or [tok.token_to_id(t) for t in SPECIAL_TOKENS] != [*range(5)]:
        raise RuntimeError("trained tokenizer does not have the expected vocab size / special token ids")
    return tok.to_str()


def _write_tokenizer(tok: Tokenizer, out: Path, model_max_length: int) -> None:
    """tokenizer.json + tokenizer_config.json + special_tokens_map.json, readable by transformers 4.x/5.x."""
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(i): {"content": tok.id_to_token(i), "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for i in sorted({*range(len(SPECIAL_TOKENS)), *tok.get_added_tokens_decoder()})
    }
    names = {"bos_token": SPECIAL_TOKENS[BOS_ID], "eos_token": SPECIAL_TOKENS[EOS_ID],
             "pad_token": SPECIAL_TOKENS[PAD_ID],
             "additional_special_tokens": [SPECIAL_TOKENS[IM_START_ID], SPECIAL_TOKENS[IM_END_ID]]}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **names, "unk_token": None,
              "add_bos_token": False, "add_eos_token": False, "add_prefix_space": False,
              "clean_up_tokenization_spaces": False, "model_max_length": model_max_length,
              "added_tokens_decoder": added, "chat_template": CHAT_TEMPLATE}
    for name, obj in (("tokenizer_config.json", config), ("special_tokens_map.json", names)):
        (out / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def _init_weights(model: Any, seed: int, std: float) -> None:
    """Norm weights = 1; every other parameter (incl. biases) ~ N(0, std) from a generator seeded by seed."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.copy_(torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=gen))


def make_tiny_model(
    out_dir: str | os.PathLike[str],
    *,
    arch: str = "llama",
    hidden_size: int = 512,
    num_layers: int = 8,
    num_heads: int = 8,
    num_kv_heads: int = 4,
    intermediate_size: int = 1408,
    vocab_size: int = 8192,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    init_std: float = DEFAULT_INIT_STD,
    sliding_window: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a seeded random-weight model dir at ``out_dir`` atomically and return its path (see module doc)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    out = Path(out_dir).expanduser().absolute()
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} already exists (pass overwrite=True to replace it)")
    config = tiny_config(
        arch, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size, vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings, init_std=init_std, sliding_window=sliding_window,
    )
    started = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tok = build_tokenizer(vocab_size, "qwen2" if arch in ("qwen2", "qwen3") else "llama")
        with torch.random.fork_rng(devices=[]):  # default init is overwritten; keep the caller's RNG intact
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _init_weights(model, seed, init_std)
        model.generation_config = GenerationConfig(
            bos_token_id=BOS_ID, eos_token_id=[EOS_ID, IM_END_ID], pad_token_id=PAD_ID)
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # no tqdm output: only `logging`
        try:
            model.save_pretrained(tmp)
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        _write_tokenizer(tok, tmp, max_position_embeddings)
        # Older readers (transformers 4.x, hand-rolled loaders) look for these keys.
        cfg = json.loads((tmp / "config.json").read_text())
        cfg.setdefault("torch_dtype", "float32")
        cfg.setdefault("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        for path in tmp.iterdir():
            path.chmod(0o644)
        tmp.chmod(0o755)
        _move_into_place(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    n_params = sum(p.numel() for p in model.parameters())
    log.info("wrote %s model (%.1fM params) to %s in %.1fs", arch, n_params / 1e6, out,
             time.perf_counter() - started)
    return out


def _move_into_place(tmp: Path, out: Path, overwrite: bool) -> None:
    """rename(tmp, out); an empty ``out`` is replaced, a full one only when ``overwrite``."""
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if overwrite and out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        out.rename(old / out.name)
        shutil.rmtree(old, ignore_errors=True)
    try:
        tmp.rename(out)
    except OSError as e:
        if out.exists():  # another writer won the race
            raise FileExistsError(f"{out} was created concurrently") from e
        raise


def default_model_dir() -> Path:
    """``$REDSERVE_CACHE_DIR/tiny-llama``, or ``~/.cache/redserve/tiny-llama``."""
    root = os.environ.get("REDSERVE_CACHE_DIR") or Path.home() / ".cache" / "redserve"
    return Path(root).expanduser() / "tiny-llama"


def ensure_default_model() -> Path:
    """Create the default tiny llama in ``default_model_dir()`` unless it is already there; return it."""
    out = default_model_dir()
    if (out / "config.json").is_file():
        return out
    try:
        return make_tiny_model(out)
    except FileExistsError:
        if (out / "config.json").is_file():
            return out
        raise


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``make-tiny-model`` options (``DIR`` plus the sizes of ``make_tiny_model``) to ``parser``."""
    parser.add_argument("out_dir", metavar="DIR", help="directory to create")
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    for flag, default in (("--hidden-size", 512), ("--num-layers", 8), ("--num-heads", 8),
                          ("--num-kv-heads", 4), ("--intermediate-size", 1408), ("--vocab-size", 8192),
                          ("--max-position-embeddings", 2048), ("--seed", 0)):
        parser.add_argument(flag, type=int, default=default, help=f"(default: {default})")
    parser.add_argument("--init-std", type=float, default=DEFAULT_INIT_STD, help="weight init std")
    parser.add_argument("--sliding-window", type=int, default=None,
                        help="attention window in tokens (mistral, qwen2/3, phi3: every layer; gemma: sliding layers)")
    parser.add_argument("--overwrite", action="store_true", help="replace DIR if it exists")


def run_from_args(args: argparse.Namespace) -> int:
    """Run ``make_tiny_model`` from parsed ``add_arguments`` options; return an exit code (0)."""
    make_tiny_model(
        args.out_dir, arch=args.arch, hidden_size=args.hidden_size, num_layers=args.num_layers,
        num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, intermediate_size=args.intermediate_size,
        vocab_size=args.vocab_size, max_position_embeddings=args.max_position_embeddings, seed=args.seed,
        init_std=args.init_std, sliding_window=args.sliding_window, overwrite=args.overwrite,
    )
    return 0
