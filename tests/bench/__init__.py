"""`kvports bench`: its rows, flags and outputs (test_bench.py), and `bench --serve` (test_serving_bench.py)."""
