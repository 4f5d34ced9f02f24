"""A stage's optimizers: the inner one that steps on every gradient, with its learning-rate schedule (``inner.py``),
and the outer one that turns an averaging round's mean into the stage's next parameters (``outer.py``). Pure torch:
no network, no records."""
