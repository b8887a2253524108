from nanovllm.engine.llm_engine import LLMEngine


class LLM(LLMEngine):
    """The public entry point: `LLM(path, **engine_options).generate(prompts, sampling_params)`.

    Engine options are the fields of nanovllm.config.Config (max_num_seqs, max_model_len, ...);
    an unknown option is a TypeError. Use it as a context manager to release workers and memory early.
    """

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.exit()
