"""`python -m nanovllm run-batch ...`: the same command line as the `nanovllm` console script."""
import sys

from nanovllm.cli import main

sys.exit(main())
