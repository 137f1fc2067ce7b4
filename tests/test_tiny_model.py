"""Tests for worker.models.tiny_model: the seeded random-weight HF model directory generator."""

from __future__ import annotations

import argparse
import json
import unicodedata
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

import worker.models.tiny_model as tm

SMALL = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=512)
FILES = {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
         "tokenizer_config.json", "special_tokens_map.json"}
# Mixed scripts, emoji (incl. ZWJ sequences), control chars, runs of spaces, literal special-token text.
UNICODE_TEXT = ("héllo  wörld\t🎉 👩‍👩‍👧 日本語のテキスト Ελληνικά русский عربى हिन्दी\n\n"
                "  x = {'a': 1}\r\n\x00\x7f ∑∫√ <|im_end|> <s> end")


@pytest.fixture
def fast_corpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Train tokenizers on 200 kB instead of the full corpus where tokenizer quality is irrelevant."""
    original = tm._corpus
    monkeypatch.setattr(tm, "_corpus", lambda: original(200_000))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: tm.make_tiny_model(root / arch, arch=arch, **SMALL) for arch in tm.ARCHS}


def test_writes_every_file_and_no_temp_leftovers(models: dict[str, Path]) -> None:
    for path in models.values():
        assert {p.name for p in path.iterdir()} == FILES
        assert {p.name for p in path.parent.iterdir()} == set(tm.ARCHS)
        config = json.loads((path / "config.json").read_text())
        assert config["torch_dtype"] == "float32" and config["vocab_size"] == SMALL["vocab_size"]
        assert all(t.dtype == torch.float32 for t in load_file(path / "model.safetensors").values())
        gen = json.loads((path / "generation_config.json").read_text())
        assert gen["eos_token_id"] == [tm.EOS_ID, tm.IM_END_ID] and gen["bos_token_id"] == tm.BOS_ID
        tok_config = json.loads((path / "tokenizer_config.json").read_text())
        assert tok_config["chat_template"] == tm.CHAT_TEMPLATE


@pytest.mark.parametrize("arch", tm.ARCHS)
def test_config_and_tokenizer_load(models: dict[str, Path], arch: str) -> None:
    config = AutoConfig.from_pretrained(models[arch])
    assert config.model_type == {"gemma3": "gemma3_text"}.get(arch, arch)
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (64, 2, 512)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    tok = AutoTokenizer.from_pretrained(models[arch])
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert len(tok) == config.vocab_size
    assert tok.convert_tokens_to_ids(list(tm.SPECIAL_TOKENS)) == [0, 1, 2, 3, 4]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (tm.BOS_ID, tm.EOS_ID, tm.PAD_ID)
    assert tok("hi").input_ids[0] != tm.BOS_ID  # no BOS added on encode


@pytest.mark.parametrize("arch", tm.ARCHS)
def test_model_loads_and_generates(models: dict[str, Path], arch: str) -> None:
    tok = AutoTokenizer.from_pretrained(models[arch])
    model = AutoModelForCausalLM.from_pretrained(models[arch]).eval()
    assert model.dtype == torch.float32
    ids = torch.tensor([tok.encode("def main():\n    return")])
    out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tm.PAD_ID)
    assert out.shape[0] == 1 and ids.shape[1] < out.shape[1] <= ids.shape[1] + 8
    assert out.max().item() < SMALL["vocab_size"]
    again = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tm.PAD_ID)
    assert torch.equal(out, again)


def test_same_seed_is_identical_other_seed_differs(models: dict[str, Path], tmp_path: Path) -> None:
    same = tm.make_tiny_model(tmp_path / "same", **SMALL)
    other = tm.make_tiny_model(tmp_path / "other", seed=1, **SMALL)
    for name in FILES:
        assert (same / name).read_bytes() == (models["llama"] / name).read_bytes(), name
    assert (other / "tokenizer.json").read_bytes() == (same / "tokenizer.json").read_bytes()
    a, b = load_file(same / "model.safetensors"), load_file(other / "model.safetensors")
    assert a.keys() == b.keys()
    assert not torch.equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])


def test_qwen2_has_qkv_bias_and_tied_embeddings(models: dict[str, Path]) -> None:
    model = AutoModelForCausalLM.from_pretrained(models["qwen2"])
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    attn = model.model.layers[0].self_attn
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert proj.bias is not None and proj.bias.abs().sum() > 0
    assert attn.o_proj.bias is None
    llama = AutoModelForCausalLM.from_pretrained(models["llama"])
    assert not llama.config.tie_word_embeddings and llama.model.layers[0].self_attn.q_proj.bias is None
    assert "lm_head.weight" in load_file(models["llama"] / "model.safetensors")


@pytest.mark.parametrize("arch", tm.ARCHS)
def test_token_ids_below_vocab_and_match_raw_tokenizer(models: dict[str, Path], arch: str) -> None:
    tok = AutoTokenizer.from_pretrained(models[arch])
    raw = Tokenizer.from_file(str(models[arch] / "tokenizer.json"))
    text = Path(tm.__file__).read_text() + UNICODE_TEXT + "".join(map(chr, range(0x20, 0x3000, 7)))
    ids = tok.encode(text)
    assert ids == raw.encode(text).ids  # what a server using `tokenizers` directly sees
    assert min(ids) >= 0 and max(ids) < SMALL["vocab_size"]
    assert max(tok.get_vocab().values()) < SMALL["vocab_size"]


@pytest.mark.parametrize("arch", tm.ARCHS)
def test_unicode_round_trip(models: dict[str, Path], arch: str) -> None:
    tok = AutoTokenizer.from_pretrained(models[arch])
    for text in (UNICODE_TEXT, "", " ", "a", "\n\n\n", "🎉" * 5, "e\u0301 ﬁ Å"):
        # qwen2/qwen3 mirror Qwen2's tokenizer, which NFC-normalizes; the others are lossless on any text.
        expected = unicodedata.normalize("NFC", text) if arch in ("qwen2", "qwen3") else text
        assert tok.decode(tok.encode(text)) == expected


def test_chat_template_renders(models: dict[str, Path]) -> None:
    tok = AutoTokenizer.from_pretrained(models["llama"])
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi ☃"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]},
        {"role": "user", "content": "Again"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi ☃<|im_end|>\n"
                    "<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\nAgain<|im_end|>\n"
                    "<|im_start|>assistant\n")
    no_prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=False)
    assert no_prompt.endswith("Hi ☃<|im_end|>\n")
    ids = tok.encode(text)
    assert ids.count(tm.IM_START_ID) == 5 and ids.count(tm.IM_END_ID) == 4
    assert ids[0] == tm.IM_START_ID


def test_short_trained_vocab_is_padded_with_reserved_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tm, "_corpus", lambda: ["hello world"])
    tok = tm.build_tokenizer(300)
    assert tok.get_vocab_size() == 300
    assert tok.id_to_token(299).startswith("<|reserved_")
    with pytest.raises(ValueError):
        tm.build_tokenizer(100)


def test_default_config_is_about_30m_params() -> None:
    config = tm.tiny_config()
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (512, 8, 8192)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    n_params = sum(p.numel() for p in model.parameters())
    assert 28e6 < n_params < 36e6, n_params


def test_existing_dir_rules(tmp_path: Path, fast_corpus: None) -> None:
    (tmp_path / "empty").mkdir()
    assert (tm.make_tiny_model(tmp_path / "empty", **SMALL) / "config.json").is_file()
    with pytest.raises(FileExistsError):
        tm.make_tiny_model(tmp_path / "empty", **SMALL)
    before = load_file(tmp_path / "empty" / "model.safetensors")["model.embed_tokens.weight"]
    tm.make_tiny_model(tmp_path / "empty", seed=3, overwrite=True, **SMALL)
    after = load_file(tmp_path / "empty" / "model.safetensors")["model.embed_tokens.weight"]
    assert not torch.equal(before, after)
    assert [p.name for p in tmp_path.iterdir()] == ["empty"]  # no temp dirs left behind


def test_ensure_default_model_creates_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fast_corpus: None
) -> None:
    monkeypatch.setenv("REDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    assert tm.default_model_dir() == tmp_path / "cache" / "tiny-llama"
    calls: list[Path] = []
    real = tm.make_tiny_model

    def small(out: Path) -> Path:
        calls.append(out)
        return real(out, **SMALL)

    monkeypatch.setattr(tm, "make_tiny_model", small)
    first = tm.ensure_default_model()
    assert first == tm.default_model_dir() and (first / "model.safetensors").is_file()
    assert tm.ensure_default_model() == first and len(calls) == 1


def test_cli_arguments(tmp_path: Path, fast_corpus: None) -> None:
    parser = argparse.ArgumentParser()
    tm.add_arguments(parser)
    args = parser.parse_args([
        str(tmp_path / "cli"), "--arch", "qwen2", "--hidden-size", "32", "--num-layers", "1",
        "--num-heads", "2", "--num-kv-heads", "1", "--intermediate-size", "64", "--vocab-size", "400",
        "--seed", "7",
    ])
    assert tm.run_from_args(args) == 0
    config = AutoConfig.from_pretrained(tmp_path / "cli")
    assert (config.model_type, config.hidden_size, config.vocab_size) == ("qwen2", 32, 400)
    defaults = parser.parse_args(["x"])
    assert (defaults.arch, defaults.hidden_size, defaults.vocab_size, defaults.seed) == ("llama", 512, 8192, 0)
