"""Hugging Face model directories in and out, with NumPy only (no transformers, no torch).

Import: `config.json` plus `*.safetensors` (one file or shards) of model type gpt2,
llama or mistral -> a ModelConfig and tensors in our names and (out, in) layouts.
Export: our weights (or a GGUF file's) -> a gpt2, llama or mistral directory transformers can load.
Text: prompts in and tokens out through a local tokenizer.json.

One module per job:
- `hf_config`: config.json fields <-> ModelConfig (mapped, checked, or refused by name)
- `checkpoint`: reading a directory's config.json, and its safetensors shards through the one reader
- `tensors`: Hugging Face tensor names and layouts <-> ours (an import's plan, checked from the headers)
- `importer`: `import_hf`, the three above in order
- `exporter`: `export_hf` (gpt2, llama or mistral), `export_gpt2`
- `text`: the tokenizer (the `tokenizers` package, imported only when text is asked for)
"""

from kvports.formats.hf.exporter import export_gpt2, export_hf
from kvports.formats.hf.hf_config import gpt2_refusal
from kvports.formats.hf.importer import import_hf

__all__ = ["export_gpt2", "export_hf", "gpt2_refusal", "import_hf"]
