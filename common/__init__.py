"""Leaf helpers every process uses: process titles, the local stack state file and where a ``--model``'s
Hugging Face directory is (``model_source``: a GGUF file converted once, by a converter its caller passes).

Rules: nothing here imports from the project's other packages (api/, broker/, engine/, worker/,
redserve/), so any of them may import it without pulling in the CLI or a layer above its own.
``model_source.convert_in_child`` runs ``python -m worker.gguf_model`` in a child process: a command
line, not an import.
"""
