"""The commands, flag by flag: generate, compare, init-weights, --device, --threads, --logprobs,
prompt files, --version. (What every command refuses: tests/bad_input/.)"""
