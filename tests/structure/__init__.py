"""What the code promises from outside, read from its sources and the registry: imports, file
names, the lessons' shape, packaging, the ports' contract, ports loaded by name, and the order
the suite runs its files in."""
