from lightning_sync.apps.bench.cli import main

main()
