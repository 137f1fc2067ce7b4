"""Leaf helpers every process uses: process titles and the local stack state file.

Rules: nothing here imports from the project's other packages (api/, broker/, engine/, worker/,
redserve/), so any of them may import it without pulling in the CLI or a layer above its own.
"""
