"""The applications built on the core (the ``apps`` extra: ``pip install 'lightning-sync[apps]'``).

``train`` (the Hydra app), ``compare`` (the main job), ``bench`` (the benchmark against the anchors), ``study`` and
``ps_study`` (the notebooks' timelines), ``netns`` (emulated hosts behind rate-limited links). The core
(:mod:`lightning_sync.strategies`, ``comm``, ``ps``) never imports this package.
"""
