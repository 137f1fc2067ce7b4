"""The OpenAI-compatible HTTP tier (Flask under gunicorn). Imports broker/ only: never torch, engine/ or worker/.

Modules: options (CLI flags), config (settings), server (gunicorn), app (routes, errors, auth),
completions / chat (the two generation endpoints), serving (shared request steps, SSE), protocol
(body parsing), generation (one request through the broker), detokenizer, stop_strings, logprobs,
tokenizer (tokenizer + chat template without torch), state (per-process state), metrics (Prometheus),
errors (OpenAI error JSON).
"""
