"""The applications built on the core (the ``apps`` extra: ``pip install 'lightning-sync[apps]'``).

``train`` (the Hydra app), ``compare`` (the main job), ``bench`` (the benchmark against the anchors), ``study`` and
``ps_study`` (the notebooks' timelines), ``cases`` (the catalogue of cases they all select from), ``runner`` (one
case trained in process), ``stats`` and ``markdown`` (seed statistics and tables), ``netns`` (emulated hosts behind
rate-limited links). They are layered without a cycle (an import-linter contract in pyproject.toml). The core
(:mod:`lightning_sync.strategies`, ``comm``, ``ps``) never imports this package.
"""
