"""How time passes: the SimPy model of disaggregated serving, predictors, metrics and the CLI."""
