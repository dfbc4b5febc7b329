"""The rank actors: vLLM's Ray executor, the workers on each platform, the RPCs every rank answers."""
