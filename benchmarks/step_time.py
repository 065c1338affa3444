"""Folded into ``python -m lightning_sync.bench`` (step time of the modes against the anchors); this calls it."""

from lightning_sync.apps.bench.cli import main

main()
