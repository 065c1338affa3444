"""Example LightningModules and data modules, used by the apps, the tests and the notebooks (the ``apps`` extra).

``models``: the digits classifier, the synthetic MLPs and the character-level language model (``CharGPT``;
``build_char_lm`` makes it with its data without Hydra); ``data``: their data modules (the UCI digits,
generated data, and text: CPython's reference text or the user's own).
"""
