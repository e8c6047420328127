"""pelab's run plumbing: config checks, secret redaction, Hydra callbacks, a fail-safe W&B logger."""
