"""What the ports are measured against, not ports themselves: the seed's own cached
generation (`seed_concat`) and Hugging Face's GPT-2 `generate` (`hf_gpt2`). Each offers
the calls `kvports bench` makes of a port: NAME, MODES, versions, load_model,
generate (with on_token), synchronize, matvec_seconds."""
