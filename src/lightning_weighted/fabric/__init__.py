"""Fabric strategies (:mod:`~lightning_weighted.fabric.strategies`), each over one engine, for a Fabric loop."""
