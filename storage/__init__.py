"""Shared-storage interfaces of AstraFlow: the Zarr trajectory store (``storage.trajectories``),
the versioned weight store (``storage.weights``) and the one module that owns the on-disk layout
(``storage.paths``). Never imports ``astraflow``: it is the layer every component builds on."""
