from lightning_sync.bench.cli import main

main()
