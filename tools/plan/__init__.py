"""`python -m tools.plan`: per-rank state, cache and exchange of a city-sized run, planned without
rendering from the trainer's own layout code (`train.layout`). See docs/plan.md."""
