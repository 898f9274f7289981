"""Pure policy: budgets, the loop's decisions, the replay fold and redaction. No I/O here."""
