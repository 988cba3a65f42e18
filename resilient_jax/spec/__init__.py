"""What a run is asked to do, parsed and checked, with no JAX: the model families' settings
(`model`), where workers go (`placement`) and the faults a run injects (`faults`). The bottom of
the house above `checks`: `config` builds on it, nothing here imports the rest."""
