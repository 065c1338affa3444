"""``python -m lightning_sync.ps ...``: one dedicated parameter server (:func:`lightning_sync.ps.server.main`)."""

from lightning_sync.ps.server import exit_after

exit_after()
