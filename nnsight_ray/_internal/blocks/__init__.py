"""A request's block on the rank: graph modes and taps, snapshots, block names, shared blocks, envoy refs."""
