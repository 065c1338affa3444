"""Example LightningModules and data modules, used by the apps, the tests and the notebooks (the ``apps`` extra).

``models``: the digits classifier and the synthetic MLPs; ``data``: their data modules (scikit-learn's digits, and
generated data).
"""
