"""The formats kvports reads and writes: its weights file, GGUF files, Hugging Face directories
(convert, export), and the files `kvports fetch` brings."""
