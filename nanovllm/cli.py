"""The `nanovllm` command line. Parsing imports no torch, so --help and usage errors answer at once; the engine is
imported only once the arguments are known good."""
import argparse
import sys

from nanovllm.batch.flags import add_engine_flags
from nanovllm.config import DATA_PARALLEL_BACKENDS

RUN_BATCH_DESCRIPTION = """\
Run an OpenAI batch-format JSONL file through the engine:
  nanovllm run-batch -i IN.jsonl -o OUT.jsonl --model PATH_OR_HUB_ID

Each input line is {"custom_id", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions", "body"}.
Lines are read lazily and each result line is written and flushed the moment its request finishes, so memory
holds the custom_ids and the requests in flight, never the file.

A bad line (not JSON, no custom_id, an unknown url, an unsupported or invalid field, a prompt too long for the
model) gets an error record ({"code", "message"}) and the run goes on. A body field that would change the result
and is not supported is an error for its line, never silently ignored. Sampling fields a request leaves out take
the checkpoint's generation_config.json defaults, as vLLM.

Resumable: run the same command again and it answers only the custom_ids missing from the output file, so in the
end each appears exactly once, also after a kill in the middle of a write.
"""


class SubcommandParser(argparse.ArgumentParser):
    """Reports an unknown flag with its own subcommand's usage, not the top-level one."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanovllm", description="nano-vllm command line")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     parser_class=SubcommandParser)
    run = commands.add_parser("run-batch", help="run an OpenAI batch-format JSONL file of requests",
                              description=RUN_BATCH_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("-i", "--input-file", required=True, metavar="IN.jsonl",
                     help="requests in OpenAI's batch format, one JSON object per line")
    run.add_argument("-o", "--output-file", required=True, metavar="OUT.jsonl",
                     help="results, one line per request; appended to, and resumed from, if it exists; must not be "
                          "the input file")
    run.add_argument("--model", required=True, metavar="PATH_OR_ID",
                     help="a local checkpoint folder (Hugging Face layout) or a hub id such as Qwen/Qwen3-0.6B "
                          "(from the Hugging Face cache, downloaded if missing and online)")
    add_engine_flags(run)
    run.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                     help="engine replicas, each on its own --tensor-parallel-size GPUs (on CPU: processes) "
                          "(default: 1)")
    run.add_argument("--data-parallel-backend", "-dpb", choices=DATA_PARALLEL_BACKENDS, default="mp",
                     help="mp: processes of this host; ray: Ray actors on the cluster RAY_ADDRESS names "
                          "(default: mp)")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # argparse would report these with the top-level usage
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        subparsers.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from nanovllm.batch.start import fail, sigterm_as_interrupt, start  # before the engine's import

    with sigterm_as_interrupt():  # a kill while the engine is imported or starts ends as Ctrl-C would
        started = start(args)  # the files checked, replicas launched
        if isinstance(started, int):
            return started
        try:
            from nanovllm.batch.run import run  # the engine and torch

            return run(args, started=started)
        except KeyboardInterrupt:  # before the engine took its first request: run() answers those after
            return fail("interrupted before any request was answered", code=130)
        finally:
            started.output.release()  # run() has, unless it never ran
            if started.launched is not None:  # replicas the engine never took over (it takes them, then stops them)
                started.launched.close()


def _version() -> str:
    from nanovllm import __version__

    return __version__


if __name__ == "__main__":
    sys.exit(main())
