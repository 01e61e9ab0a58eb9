"""Lightning Trainer strategies (:mod:`~lightning_weighted.trainer.strategies`), each over one engine."""
