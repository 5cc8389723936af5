"""Sharded checkpoints, resharding, dense export/import and parallelize()."""
__all__: list[str] = []
