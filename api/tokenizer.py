"""The served model's tokenizer and chat template, loaded without torch.

Rules:
- ``AutoTokenizer`` imports torch in transformers 5 (through ``AutoConfig``), and API processes must
  stay light and fork-safe, so the tokenizer is ``PreTrainedTokenizerFast.from_pretrained(dir)``:
  the same ``tokenizer.json``, special tokens and chat template that ``AutoTokenizer`` loads for
  fast tokenizers. A model without a ``tokenizer.json`` cannot be served (ValueError at startup).
- A GGUF ``model_dir`` means its converted cache directory (``common.model_source``): the tokenizer,
  chat template and config.json come from there. Loading a tokenizer straight from a GGUF imports
  torch (transformers' GGUF reader), so when the cache is missing it is converted in a child
  process (under the cache lock, so an engine converting the same file at once is waited for).
- Completion prompts are encoded with ``add_special_tokens=True`` (as ``tokenizer.encode`` and
  vLLM do); a rendered chat prompt with ``add_special_tokens=False`` (the template writes them).
- `render_chat` raises ValueError for a model without a chat template or a template that fails,
  for a template that runs past ``render_timeout`` seconds or ``max_render_chars`` characters, for a
  caller's own ``chat_template`` unless ``trust_request_chat_template``, and for
  ``chat_template_kwargs`` that would set the renderer's own variables (see ``api.chat_template``).
- `vocab_size` is the larger of the tokenizer's length and config.json's ``vocab_size``: token ids
  at or above it are rejected before they reach an engine.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jinja2

from api.chat_template import (
    DEFAULT_MAX_RENDER_CHARS,
    DEFAULT_RENDER_TIMEOUT,
    bound_template,
    check_template_kwargs,
    render_budget,
)
from common.model_source import convert_in_child, resolve_model_dir


class ModelTokenizer:
    """Tokenizer, detokenizer and chat template of one model directory; see the module rules."""

    def __init__(self, model_dir: str, trust_request_chat_template: bool = False,
                 render_timeout: float = DEFAULT_RENDER_TIMEOUT,
                 max_render_chars: int = DEFAULT_MAX_RENDER_CHARS) -> None:
        model_dir = resolve_model_dir(model_dir, convert_in_child)
        self.model_dir = model_dir
        if not os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
            raise ValueError(f"{model_dir} has no tokenizer.json: the API needs a fast (tokenizers) tokenizer")
        from transformers import PreTrainedTokenizerFast

        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
        config = _read_json(os.path.join(model_dir, "config.json"))
        self.vocab_size = max(len(self.tokenizer), int(config.get("vocab_size") or 0))
        self.max_position_embeddings: int | None = config.get("max_position_embeddings")
        self.trust_request_chat_template = trust_request_chat_template
        self.render_timeout = render_timeout
        self.max_render_chars = max_render_chars

    @property
    def has_chat_template(self) -> bool:
        return bool(self.tokenizer.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's own text (special tokens included), as shown in logprobs."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """The vocabulary strings of `token_ids` (e.g. byte-level 'Ġword')."""
        return [t if t is not None else "" for t in self.tokenizer.convert_ids_to_tokens(token_ids)]

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, /, **template_kwargs: Any) -> str:
        """The chat prompt text for `messages` (and `tools`, OpenAI function tools, passed to the template
        as ``tools``); ValueError if it cannot be rendered (see the module rules).

        A ``chat_template`` in `template_kwargs` is the caller's own template.
        """
        caller_template = template_kwargs.pop("chat_template", None)
        check_template_kwargs(template_kwargs, caller_template, self.trust_request_chat_template)
        if caller_template is None and not self.has_chat_template:
            raise ValueError("this model has no chat template; use /v1/completions with a plain prompt")
        try:
            template = self.tokenizer.get_chat_template(caller_template, tools or None)
            bound_template(template)
            with render_budget(self.render_timeout, self.max_render_chars):
                return self.tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                          add_generation_prompt=add_generation_prompt,
                                                          tools=tools or None, **template_kwargs)
        except (jinja2.TemplateError, TypeError, KeyError, IndexError, AttributeError, ArithmeticError,
                RecursionError) as e:
            raise ValueError(f"the chat template failed on these messages: {e}") from e


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
