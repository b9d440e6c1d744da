"""What the ports are measured against, not ports themselves: the seed's own cached
generation (`seed_concat`), Hugging Face transformers' `generate` (`hf_transformers`) and the torch
port under torch.compile (`torch_compile`). Each is a `shared.contract.Baseline`: the
calls `kvports bench` makes (NAME, MODES, versions, load_model, generate with on_token,
synchronize, matvec_seconds)."""
