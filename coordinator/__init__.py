"""The DP coordinator, a process of its own (``redserve coordinator``) that needs neither torch nor an
accelerator: ``process`` (the loop: load snapshot, wave counter, engine liveness), ``rules`` (what it decides,
as pure functions of what it read), ``leader_lock`` (one active coordinator, the others standing by).

It talks to the rest only through Redis keys (``broker.keys``) and the load snapshot format
(``broker.load_balance``), so it imports from ``broker/`` and nothing from ``engine/`` or ``worker/``."""
