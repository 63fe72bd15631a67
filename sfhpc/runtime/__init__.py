"""Runtime: what runs on every rank of a job (identity, communicators, the rank's role program)."""
