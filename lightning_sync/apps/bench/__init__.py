"""The benchmark: our sync modes and their anchors side by side, on loopback or on emulated slow links.

``python -m lightning_sync.bench`` (or ``lightning-sync-bench``; ``--help`` lists every knob). Modules: ``config``
(the knobs, checked before anything starts), ``launch`` (two torchrun nodes per run, on loopback or in network
namespaces), ``worker`` (one rank of one run), ``clock`` and ``lightning_parts`` (what the ranks measure with),
``report`` (medians, ratios, JSON, Markdown, plots) and ``cli`` (the command).
"""
