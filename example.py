"""Generate from a few prompts. With no --model, a checkpoint of --shape with RANDOM weights is written on first
use (to $NANOVLLM_CACHE, else ~/.cache/nanovllm) and used, so the text is gibberish: the point is that the whole
engine runs. `python example.py --shape tiny` takes seconds on a CPU; the default Qwen3-0.6B shape writes about
1.2 GB."""
import argparse

from nanovllm import LLM, SamplingParams
from nanovllm.utils.random_checkpoint import SHAPE_NAMES, default_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, metavar="PATH_OR_ID",
                        help="a local checkpoint folder or a Hugging Face hub id (default: a random-weight "
                             "checkpoint of --shape)")
    parser.add_argument("--shape", default="Qwen3-0.6B", choices=SHAPE_NAMES, metavar="SHAPE",
                        help=f"shape of the random-weight checkpoint when --model is unset, one of: "
                             f"{', '.join(SHAPE_NAMES)} (default: Qwen3-0.6B)")
    args = parser.parse_args()
    path = args.model or default_checkpoint(args.shape)

    with LLM(path, max_model_len=1024, max_num_seqs=16) as llm:
        params = SamplingParams(temperature=0.6, max_tokens=32)
        questions = ["introduce yourself", "list all prime numbers within 100"]
        conversations = [[{"role": "user", "content": question}] for question in questions]
        for output in llm.chat(conversations, params):  # the checkpoint's chat template, as vLLM's LLM.chat
            completion = output.outputs[0]
            print(f"\nPrompt: {output.prompt!r}\nCompletion: {completion.text!r} ({completion.finish_reason})")


if __name__ == "__main__":
    main()
