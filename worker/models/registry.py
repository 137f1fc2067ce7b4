"""Which model class serves each Hugging Face ``architectures`` name.

Rules:
- A config is served when any of its ``architectures`` is a key here; anything else fails at load with
  the list of supported names (``worker.model_loader.load_config``).
"""

from __future__ import annotations

from worker.models.gemma import GemmaForCausalLM
from worker.models.llama import LlamaForCausalLM
from worker.models.phi3 import Phi3ForCausalLM
from worker.models.qwen3 import Qwen3ForCausalLM

ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
}
