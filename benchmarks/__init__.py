"""``make bench``: figures about the harness itself, each with its target (see README)."""
