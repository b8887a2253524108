"""run-batch, below the command line (cli.py) and above data_parallel and the engine: the input and the result
records (io.py), the output file while a run holds it (output.py), one request body -> a prompt and
SamplingParams (requests.py), the checks and launches before the engine's import (start.py), the run itself
(run.py), and the engine options as flags (flags.py). Nothing is imported here, so that start.py can run before
the engine's import."""
