"""GGUF files (llama.cpp's format): weights (`reader`) and text (`tokenizer`), read by the
`gguf` library; nothing here parses the format by hand."""
