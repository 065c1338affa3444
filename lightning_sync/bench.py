"""``python -m lightning_sync.bench``: runs the benchmark, :mod:`lightning_sync.apps.bench` (the ``apps`` extra)."""

if __name__ == "__main__":
    from lightning_sync._entry import run_app

    run_app("lightning_sync.apps.bench")
