"""Framework-neutral parts of kvports: config, weights file, input checks,
comparison, the command line and the benchmark. Imports NumPy and nothing heavier."""
