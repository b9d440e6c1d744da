"""The `kvports` subcommands, one module each (the bench's is the `kvports.bench`
package). Each has HELP, add_arguments(parser) and run(args) -> exit status; `kvports.cli`
only builds the parser from them and dispatches. NumPy only at import: ports and heavy
libraries load inside run()."""
