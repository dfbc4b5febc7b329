"""The engine actor's logic: vLLM's async engine, prompt rendering, engine parity, platform choices."""
