"""The NumPy port: plain arrays on the CPU, checked against the PyTorch reference."""
