"""``python -m lightning_sync.train``: runs the Hydra app, :mod:`lightning_sync.apps.train` (the ``apps`` extra)."""

if __name__ == "__main__":
    from lightning_sync._entry import run_app

    run_app("lightning_sync.apps.train")
