"""Every bad input, by what is refused: weights files, Hugging Face directories, GGUF files,
prompts and text, sizes and counts, numbers that overflow, output paths, the command line itself,
request files, the API's arguments.

Each refusal is one `error:` line on stderr naming the value and the limit, exit 2, nothing on
stdout, the same for every framework, caught in shared/ (or the run layer) before any port runs
and, where the header tells, before any tensor is read; or, where the input is valid after all,
the same correct tokens in every port. One table per class of bad input: the next bad input is a
line in its table."""
