"""``python -m lightning_sync.compare``: runs the main job, :mod:`lightning_sync.apps.compare` (the ``apps`` extra)."""

if __name__ == "__main__":
    from lightning_sync._entry import run_app

    run_app("lightning_sync.apps.compare")
