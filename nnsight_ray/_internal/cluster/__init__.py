"""Where ranks run and who is alive: placement, topology, liveness, Ray's errors."""
