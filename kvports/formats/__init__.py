"""The files kvports reads and writes: its weights file, GGUF files, Hugging Face directories, chat templates."""
