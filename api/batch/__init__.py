"""Batch jobs: OpenAI batch files run as Celery tasks through the same broker as the API.

Modules, one job each:
- `records`: the OpenAI batch file formats (input lines in, output lines out).
- `store`: a batch's state in Redis (items, per-item claims and results, counters).
- `runner`: answers one batch item exactly as the HTTP API would (non-streaming).
- `chunk`: runs one chunk of items idempotently (claims, waiting on other workers, recording).
- `sweeper`: queues the chunks of stalled batches again (the safety net under Celery's redelivery).
- `tasks`: the Celery app, its settings and the `run_chunk` task.
- `cli`: ``redserve batch worker | submit | status | results``.

Nothing here imports torch, `engine/` or `worker/`: a batch worker never loads a model.
"""
