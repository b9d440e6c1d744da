"""The JAX/Flax port: flax.nnx, with the KV cache as a donated pytree and each generation one compiled call."""
