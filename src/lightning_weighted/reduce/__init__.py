"""How each engine's reduction brings a window's ``N`` to its gradients (see :mod:`lightning_weighted.window`)."""
