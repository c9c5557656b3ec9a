"""The only code that knows lm-eval internals: model wrapper, task glue, CLI."""
