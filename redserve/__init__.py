"""The ``redserve`` command line and the single-node stack launcher."""
