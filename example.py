"""Generate from a few prompts. With no --model, a Qwen3-0.6B-shaped checkpoint with RANDOM weights is used,
so the text is gibberish: the point is that the whole engine runs."""
import argparse

from nanovllm import LLM, SamplingParams
from nanovllm.utils.random_checkpoint import default_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: random weights)")
    parser.add_argument("--shape", default="Qwen3-0.6B")
    args = parser.parse_args()
    path = args.model or default_checkpoint(args.shape)

    with LLM(path, max_model_len=1024, max_num_seqs=16) as llm:
        params = SamplingParams(temperature=0.6, max_tokens=32)
        prompts = ["introduce yourself", "list all prime numbers within 100"]
        prompts = [
            llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                              add_generation_prompt=True)
            for p in prompts
        ]
        for prompt, output in zip(prompts, llm.generate(prompts, params)):
            completion = output.outputs[0]
            print(f"\nPrompt: {prompt!r}\nCompletion: {completion.text!r} ({completion.finish_reason})")


if __name__ == "__main__":
    main()
