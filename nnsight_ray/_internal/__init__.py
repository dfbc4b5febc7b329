"""Private implementation; the public surface is ``nnsight_ray.__all__``."""
