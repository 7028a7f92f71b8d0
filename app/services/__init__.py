"""Business rules. Services flush but never commit: the caller owns the transaction."""
