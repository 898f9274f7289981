"""Pure policy that needs the run's secrets: redaction (``redact``) and safe texts. The
run's decisions, the fold, budgets and vocabularies moved to ``boundloop.core`` (#21);
``policy.decide``, ``policy.replay``, ``policy.budget`` and ``policy.kinds`` re-export them."""
