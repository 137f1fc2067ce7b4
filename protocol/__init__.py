"""What every tier agrees on, importing neither torch nor redis (nor flask): the shapes and checks that the
API, the broker and the engine share. Imports run one way into it: api -> broker -> protocol and
engine -> worker -> protocol; it imports nothing of theirs.

- ``sampling_params``: ``SamplingParams``, what a request asks of generation, checked once where it is built.
- ``grammar_spec``: a structured-output spec as it travels in the sampling parameters, turned into an
  llguidance grammar, and why one cannot compile (the API's 400, the engine's matcher).
- ``wire_schema``: ``@wire``, a dataclass declared once as a wire type gets its msgpack codec and checks.
- ``messages``: every message that crosses Redis between the API's broker client and the engines.
- ``step_types``: what the scheduler sends its workers each step and what they send back.
- ``errors``: ``MessageError``, what decoding bytes that are not a message raises.
- ``engine_load``: ``EngineLoad``, an engine's load figures (waiting, running, KV usage, step) as the engine
  measures them, its stats carry them through Redis, the coordinator snapshots them and the API scores them.
- ``prefix_hash``: the chained hashes of a prompt's full KV blocks, the same in the API's cache-aware router
  and the engine's prefix cache.
- ``output_processor``: engine outputs turned into each choice's text (with ``detokenizer`` and
  ``stop_strings``), the one output path of the API and the offline ``LLM``.
"""
