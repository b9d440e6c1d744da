"""The PyTorch port: the reference the other two are checked against."""
