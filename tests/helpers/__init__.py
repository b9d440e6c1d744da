"""What the test files share, by role; each import names its module (`from tests.helpers.models
import GOLDEN`). conftest.py holds only fixtures and the session's settings.

- models.py: the seed's golden tokens and prompt, a tiny model of each family, random weights and prompts
- ports.py: ports by name (port_or_skip, hide_port) and calling_internals
- commands.py: a command run in this process (run_cli), the one error line of a refusal, processes
- agreement.py: the assertions that hold one run's tokens, logits or tensors to another's
- weights_files.py: safetensors files written byte by byte, and files of any size that take no disk
- hf_files.py: Hugging Face directories written by hand (no transformers)
- hf_reference.py: tiny models built with transformers' own classes, run by its own generate
- gguf_files.py: GGUF files written by the gguf library as llama.cpp writes them
- parallel.py: tensor parallelism's runs in a subprocess with 4 simulated JAX devices
- checker.py, compiles.py, servers.py, slow_serve.py: the checker's plug-ins, compile counting, running servers
"""
