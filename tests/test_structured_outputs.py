"""Structured outputs (xgrammar) on CPU: the spec's checks, outputs that parse and match their spec, greedy equal to
transformers under the same mask, free rows untouched by constrained ones, and the engine's edges (compile errors
before any work, padded vocabularies, whitespace bounds, one compile per distinct spec)."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.shared_memory import SharedMemory

import pytest
import torch
import xgrammar as xgr
from hf_reference import assert_no_leaks
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.sampling import grammar_mask, mask_worker
from nanovllm.sampling.grammar import JSON_WHITESPACE_LIMIT, GrammarCompiler, GrammarState
from nanovllm.sampling.grammar_mask import GrammarMasks
from nanovllm.sampling.mask_process import MaskProcess
from nanovllm.sampling.mask_worker import MASK_READY, TOKENS_LANDED, MaskWorker
from nanovllm.utils.random_checkpoint import write_random_checkpoint

PADDING = 24  # model rows past the tokenizer's last token
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["name", "age", "ok", "color"], "additionalProperties": False}
REGEX = r"[a-c]{2}-\d{1,3}"
CHOICES = ["yes", "no", 'say "maybe"', "a\\b"]
GRAMMAR = 'root ::= "(" [0-9]{1,4} ("+" [0-9]{1,4}){0,3} ")"'
SPECS = {"json": StructuredOutputsParams(json=SCHEMA),
         "json_text_compact": StructuredOutputsParams(json=json.dumps(SCHEMA), disable_any_whitespace=True),
         "regex": StructuredOutputsParams(regex=REGEX), "choice": StructuredOutputsParams(choice=CHOICES),
         "grammar": StructuredOutputsParams(grammar=GRAMMAR), "json_object": StructuredOutputsParams(json_object=True)}


@pytest.fixture(scope="module")
def padded_model(tmp_path_factory) -> str:
    return write_random_checkpoint(str(tmp_path_factory.mktemp("qwen3-tiny-padded")), "tiny", seed=3,
                                   vocab_padding=PADDING)


@pytest.fixture(scope="module")
def llm(padded_model):
    with LLM(padded_model, num_kvcache_blocks=48, max_model_len=1024) as engine:
        yield engine


class Row:
    """What the mask reads of a request (sampling/rows.py): no prompt, the tokens generated so far."""

    def __init__(self, seq_id: int, grammar) -> None:
        self.seq_id, self.grammar, self.token_ids, self.num_prompt_tokens = seq_id, grammar, [], 0

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


class LocalWorker:
    """The mask worker's protocol (MaskProcess: send, receive) served in this process, at once: a test reaches the
    worker's state and can make its calls fail."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.worker = MaskWorker(compiler.info.serialize_json(), compiler.stop_token_ids)
        self.answers: list = []

    def send(self, method: str, *args) -> None:
        if method == "attach":
            layout, name, threads = args
            self.shared = SharedMemory(name=name)
            self.worker.attach(layout, self.shared.buf, threads)
        elif method == "fill":
            self.answers.append((args[0], self.worker.fill(*args)))
        else:
            getattr(self.worker, method)(*args)

    def receive(self):
        waited = time.perf_counter()
        while not self.answers:  # a test's late fill (in a thread) is answered just after its counter is written
            assert time.perf_counter() - waited < 30, "no answer from the local worker"
            time.sleep(0.001)
        return self.answers.pop(0)


def masks_and_rows(padded_model: str, names: list[str], local: bool = True, vocab: int = 1024,
                   device: torch.device = torch.device("cpu"), max_rows: int = 8):
    """The tokenizer, its grammar compiler (close it), one constrained row per SPECS name (None: a free row), and
    mask buffers for `max_rows` rows over `vocab` ids, served by a LocalWorker (local) or the worker process."""
    tokenizer = AutoTokenizer.from_pretrained(padded_model)
    compiler = GrammarCompiler(tokenizer, vocab, [tokenizer.eos_token_id])
    worker = LocalWorker(compiler) if local else compiler.start_worker(MaskProcess).result()
    rows = [Row(i, None if name is None else GrammarState(compiler.submit(SPECS[name]), SPECS[name]))
            for i, name in enumerate(names)]
    return tokenizer, compiler, rows, GrammarMasks(worker, vocab, max_rows, device)


class Reference:
    """xgrammar's own matcher per constrained row, fed the same tokens: what each row's mask must be."""

    def __init__(self, compiler: GrammarCompiler, rows: list[Row], eos: int) -> None:
        self.eos = eos
        self.matchers = {row.seq_id: xgr.GrammarMatcher(compiler.submit(row.grammar.spec).result())
                         for row in rows if row.grammar is not None}

    def masked(self, row: Row, logits: torch.Tensor) -> torch.Tensor:
        """`logits` (one row) as row's mask must leave them: xgrammar's own, or only the end once it ended."""
        expected = logits.clone()
        matcher = self.matchers.get(row.seq_id)
        if matcher is not None and matcher.is_terminated():
            expected[:] = -float("inf")
            expected[self.eos] = logits[self.eos]
        elif matcher is not None:
            bitmask = xgr.allocate_token_bitmask(1, len(logits))
            matcher.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(expected[None], bitmask)
        return expected

    def take(self, row: Row, token: int) -> None:
        matcher = self.matchers.get(row.seq_id)
        if matcher is not None and not matcher.is_terminated():
            assert matcher.accept_token(token), f"row {row.seq_id} sampled {token}, which its grammar refuses"


def sample_a_step(masks: GrammarMasks, batch: list[Row], reference: Reference) -> None:
    """One step of the host path, as the engine takes it: the step's mask (each row's must be the reference's),
    each row's first allowed token but the end (the end once nothing else is allowed), the tokens to the worker
    and the fill ahead."""
    mask = masks.finish(masks.start(batch))
    logits = torch.zeros(len(batch), masks.vocab_size)
    mask.apply(logits)
    tokens = []
    for i, row in enumerate(batch):
        assert torch.equal(logits[i], reference.masked(row, torch.zeros(masks.vocab_size))), f"row {row.seq_id}"
        allowed = torch.isfinite(logits[i]).nonzero().flatten()
        going_on = allowed[allowed != reference.eos]
        tokens.append(int(going_on[0]) if len(going_on) else reference.eos)
        row.token_ids = row.token_ids + [tokens[-1]]
        reference.take(row, tokens[-1])
    masks.after_sample(batch, [True] * len(batch), torch.tensor(tokens))


def own_masked_logits(matcher, vocab: int) -> torch.Tensor:
    """Zero logits with xgrammar's own mask for `matcher`'s next token applied (-inf where refused)."""
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(bitmask)
    logits = torch.zeros(1, vocab)
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    return logits[0]


def check_schema(value) -> None:
    """SCHEMA's rules, checked by hand (no validator needed where the GPU tests run)."""
    assert isinstance(value, dict) and set(value) == {"name", "age", "ok", "color"}, value
    assert isinstance(value["name"], str) and len(value["name"]) <= 6, value
    assert type(value["age"]) is int and 0 <= value["age"] <= 120, value
    assert type(value["ok"]) is bool and value["color"] in ("red", "green", "blue"), value


def check_matches(kind: str, text: str) -> None:
    if kind.startswith("json") and kind != "json_object":
        # strict=False: xgrammar lets a string with maxLength hold control characters, which strict JSON refuses
        check_schema(json.loads(text, strict=False))
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(r"\(\d{1,4}(\+\d{1,4}){0,3}\)", text), text


def test_the_spec_is_checked_when_made():
    from nanovllm.sampling_params import StructuredOutputsParams as same  # vLLM's module path too
    assert same is StructuredOutputsParams
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar, json_object; got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got json and regex"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    with pytest.raises(ValueError, match=r"choice=\[\] is out of range"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="whitespace_pattern.*xgrammar has no whitespace pattern"):
        StructuredOutputsParams(json=SCHEMA, whitespace_pattern=r"[ ]?")
    with pytest.raises(ValueError, match="json=3 is out of range"):
        StructuredOutputsParams(json=3)
    spec = StructuredOutputsParams(regex="a+")
    for name, value in (("ignore_eos", True), ("min_tokens", 2)):
        with pytest.raises(ValueError, match=f"SamplingParams.{name}={value!r} cannot be combined with "
                                             f"structured_outputs"):
            SamplingParams(structured_outputs=spec, **{name: value})
    with pytest.raises(ValueError, match="structured_outputs='a' is out of range"):
        SamplingParams(structured_outputs="a")


def test_every_kind_parses_and_matches_its_spec_with_n_samples(llm):
    kinds = list(SPECS)
    params = [SamplingParams(temperature=1.0, seed=i, n=3, max_tokens=200, structured_outputs=SPECS[kind])
              for i, kind in enumerate(kinds)]
    outputs = llm.generate(["Give me data:"] * len(kinds), params, use_tqdm=False)
    for kind, output in zip(kinds, outputs):
        assert len(output.outputs) == 3
        for sample in output.outputs:
            if kind == "json_object" and sample.finish_reason == "length":
                continue  # any object: a random model's strings need not end (the matcher test below covers it)
            assert sample.finish_reason == "stop", (kind, sample.text)
            check_matches(kind, sample.text)
            assert all(t < llm.config.hf_config.vocab_size - PADDING for t in sample.token_ids)
    compact = outputs[kinds.index("json_text_compact")].outputs[0].text
    assert not re.search(r"\s", compact.replace(json.loads(compact, strict=False)["name"], "")), compact
    assert_no_leaks(llm)


def test_a_reply_cut_by_max_tokens_is_returned_as_it_is(llm):
    out = llm.generate(["x"], SamplingParams(temperature=0, max_tokens=3,
                                             structured_outputs=SPECS["json"]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3 and out.text.startswith("{")


def hf_constrained_greedy(hf_model, tokenizer, vocab_size: int, prompt: list[int], spec, max_tokens: int) -> list[int]:
    """transformers' model, xgrammar's mask applied by hand to each step's logits, argmax."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=[tokenizer.eos_token_id])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(spec, any_whitespace=True,
                                                             max_whitespace_cnt=JSON_WHITESPACE_LIMIT)
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    ids = list(prompt)
    for _ in range(max_tokens):
        logits = hf_model(torch.tensor([ids])).logits[:, -1].float()
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        token = int(logits.argmax())
        ids.append(token)
        if token == tokenizer.eos_token_id:
            break
        assert matcher.accept_token(token)
    return ids[len(prompt):]


def test_constrained_greedy_equals_transformers_with_the_mask_by_hand(llm, padded_model):
    hf_model = AutoModelForCausalLM.from_pretrained(padded_model).eval()
    tokenizer = AutoTokenizer.from_pretrained(padded_model)
    prompts = [[5, 17, 300], [900, 2, 44, 61, 7], [12]]
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=SPECS["json"])
    ours = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]
    with torch.no_grad():
        theirs = [hf_constrained_greedy(hf_model, tokenizer, llm.config.hf_config.vocab_size, p, SCHEMA, 40)
                  for p in prompts]
    assert ours == theirs


def test_free_rows_are_untouched_by_constrained_rows_through_preemption_chunks_and_prefix_hits(padded_model):
    # a cache too small for every request at once (preemption), a prefill budget below the longest prompt
    # (chunked prefill), and prompts that share a prefix (prefix-cache hits)
    shared = list(range(40, 340))
    free_prompts = [shared + [7, i] for i in range(4)] + [list(range(500, 780))]
    free = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
            SamplingParams(temperature=0.9, seed=11, max_tokens=48, ignore_eos=True, n=2)]
    free_params = [free[i % 2] for i in range(len(free_prompts))]
    options = dict(num_kvcache_blocks=14, kvcache_block_size=64, max_num_batched_tokens=256, max_model_len=1024)
    with LLM(padded_model, **options) as alone:
        expected = [[c.token_ids for c in o.outputs] for o in alone.generate(free_prompts, free_params,
                                                                             use_tqdm=False)]
    constrained = [SamplingParams(temperature=0.8, seed=i, n=2, max_tokens=120, structured_outputs=spec)
                   for i, spec in enumerate(SPECS.values())]
    with LLM(padded_model, **options) as mixed:
        preempted = []
        original = mixed.scheduler._preempt
        mixed.scheduler._preempt = lambda seq: (preempted.append(seq), original(seq))[1]
        prompts = [p for pair in zip(free_prompts, [shared + [9, i] for i in range(5)]) for p in pair]
        params = [p for pair in zip(free_params, constrained) for p in pair] + constrained[5:]
        prompts += [shared + [1]] * (len(params) - len(prompts))
        outputs = mixed.generate(prompts, params, use_tqdm=False)
        assert preempted, "the cache was meant to be too small for every request at once"
        assert [[c.token_ids for c in o.outputs] for o in outputs[0::2][:len(free_prompts)]] == expected
        kinds = list(SPECS)
        for i, output in enumerate([*outputs[1::2], *outputs[2 * len(free_prompts):]][:len(kinds)]):
            for sample in output.outputs:
                if sample.finish_reason == "stop":
                    check_matches(kinds[i], sample.text)
        assert_no_leaks(mixed)


def test_a_spec_that_does_not_compile_fails_before_any_work_and_the_engine_goes_on(llm):
    good = SamplingParams(temperature=0, max_tokens=4)
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(ab"))
    generated = llm.token_counter.generated
    with pytest.raises(ValueError, match="structured_outputs regex does not compile: Regex parsing error at "
                                         "position 4: The parenthesis is not closed"):
        llm.generate(["a", "b"], [good, bad], use_tqdm=False)
    assert llm.token_counter.generated == generated  # nothing ran
    assert llm.scheduler.is_finished()
    bad_schema = SamplingParams(structured_outputs=StructuredOutputsParams(json='{"type": "object", '))
    results = dict(llm.iter_generate(["a", "b", "c"], iter([good, bad_schema, good]), errors="yield"))
    assert isinstance(results[1], ValueError) and "json does not compile: Failed to parse JSON" in str(results[1])
    assert [len(results[i].outputs[0].token_ids) for i in (0, 2)] == [4, 4]
    assert_no_leaks(llm)


def test_identical_specs_compile_once_and_distinct_ones_apart(padded_model):
    tokenizer = AutoTokenizer.from_pretrained(padded_model)
    compiler = GrammarCompiler(tokenizer, 1024, [tokenizer.eos_token_id])
    reordered = dict(reversed(list(SCHEMA.items())))
    first = compiler.submit(StructuredOutputsParams(json=SCHEMA))
    assert compiler.submit(StructuredOutputsParams(json=reordered)) is first
    assert compiler.submit(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)) is not first
    assert compiler.submit(StructuredOutputsParams(regex="a")) is not compiler.submit(StructuredOutputsParams(
        regex="b"))
    compiler.close()


def test_json_whitespace_is_bounded_and_compact_has_none(padded_model):
    tokenizer = AutoTokenizer.from_pretrained(padded_model)
    compiler = GrammarCompiler(tokenizer, 1024, [tokenizer.eos_token_id])

    def accepts(spec: StructuredOutputsParams, text: str) -> bool:
        return xgr.GrammarMatcher(compiler.submit(spec).result()).accept_string(text)

    loose, compact = SPECS["json"], StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    assert accepts(loose, "{" + " " * JSON_WHITESPACE_LIMIT + '"name"')
    assert not accepts(loose, "{" + " " * (JSON_WHITESPACE_LIMIT + 1) + '"name"')
    assert accepts(compact, '{"name":"ab","age":3')
    assert not accepts(compact, '{ "name"') and not accepts(compact, '{"name": "ab"')
    any_object = StructuredOutputsParams(json_object=True)
    assert accepts(any_object, '{"k": [1, {"x": null}], "other": "v"}') and accepts(any_object, "{}")
    assert not accepts(any_object, "[1]") and not accepts(any_object, '"text"')
    compiler.close()


def test_the_mask_covers_the_padded_rows_and_leaves_free_rows(padded_model):
    """Through the worker's own process: a constrained row between two free ones."""
    tokenizer, compiler, rows, masks = masks_and_rows(padded_model, [None, "choice", None], local=False)
    vocab = masks.vocab_size
    mask = masks.finish(masks.start(rows))
    logits = torch.zeros(3, vocab)
    logits[:, vocab - PADDING:] = 100.0  # padded rows a random head may well favour
    mask.apply(logits)
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed == sorted({tokenizer.encode(w)[0] for w in CHOICES}), allowed
    assert torch.equal(logits[0], logits[2]) and torch.isfinite(logits[0]).all()
    masks.close()
    compiler.close()
    assert compiler.worker.result().process.poll() == 0, "the worker did not stop when its compiler closed"


@pytest.mark.parametrize("worker", ["process", "process, counter", "local", "local, xgrammar's public calls",
                                    "local, halves"])
def test_masks_step_by_step_equal_xgrammar_own(padded_model, worker, monkeypatch):
    """The host path, step after step: every step's mask equals xgrammar's own matcher's, fed the same tokens,
    and a row whose matcher took the end gets only the end; in the worker's process, and in this one with
    xgrammar's public calls (what an xgrammar whose bindings differ gets), and with every fill ahead split in
    halves (as one of many rows is); and in the order of the device path (each mask read once the worker's counter
    says it is written, each answer read after the next step's start)."""
    if "halves" in worker:
        monkeypatch.setattr(mask_worker, "SHARD_ROWS", 2)
    _masks_step_by_step(padded_model, torch.device("cpu"), worker)


def test_a_row_that_sat_out_a_step_keeps_the_mask_filled_ahead_for_it(padded_model):
    """Rows A and B sample a step, a step of only a new request C follows (a prefill of others), then all three
    sample: A's and B's masks, filled ahead after their step into the other buffer, are used as they are, and only
    C's first mask is filled when its step starts. Each step's mask equals xgrammar's own."""
    tokenizer, compiler, (a, b, c), masks = masks_and_rows(padded_model, ["json_text_compact", "regex", "choice"])
    reference = Reference(compiler, [a, b, c], tokenizer.eos_token_id)
    filler = masks.worker.worker.filler
    filled, fill = [], filler.fill  # per fill of rows: how many
    filler.fill = lambda constraints, at: (filled.append(len(constraints)), fill(constraints, at))

    def step(batch: list[Row]) -> None:
        filled.clear()
        sample_a_step(masks, batch, reference)

    step([a, b])
    step([c])
    assert filled == [1, 1]  # C's first mask at the start, its next one ahead
    step([a, b, c])
    assert filled == [3], "A's and B's masks were filled again at the step's start"
    step([a, b, c])
    compiler.close()


def test_a_fill_ahead_that_fails_midway_leaves_no_row_reading_its_half_written_buffer(padded_model, caplog):
    """Row S samples one step, then sits out two (a prefill of others); the second of A's and B's fills ahead goes
    into the buffer that holds S's mask, writes over it, and fails. When all three sample again, S's mask is
    filled anew, not read from that buffer, A's and B's matchers catch up from the tokens the worker kept, every
    mask is xgrammar's own, and the failure is logged."""
    tokenizer, compiler, (sat_out, a, b), masks = masks_and_rows(padded_model,
                                                                  ["json_text_compact", "regex", "choice"])
    reference = Reference(compiler, [sat_out, a, b], tokenizer.eos_token_id)
    filler = masks.worker.worker.filler
    fill, failing = filler.fill, [False]

    def half_written(constraints, at):
        if failing[0]:  # the step's fill ahead: its rows are written over, then xgrammar fails
            filler.rows[list(at)] = 0
            raise RuntimeError("fill failed")
        fill(constraints, at)
    filler.fill = half_written

    step = lambda batch: sample_a_step(masks, batch, reference)  # noqa: E731
    step([sat_out, a, b])  # S's next mask: row 0 of the buffer filled ahead
    step([a, b])
    failing[0] = True
    step([a, b])  # its fill ahead goes to S's buffer, writes rows 0 and 1, fails
    failing[0] = False
    step([sat_out, a, b])
    assert "filling structured-output masks ahead failed" in caplog.text and "fill failed" in caplog.text
    step([sat_out, a, b])
    compiler.close()


def test_a_token_its_mask_refused_ends_that_row_only(padded_model):
    """A row whose sampled token its mask did not allow (every allowed token banned, say) may only end; the row
    beside it, whose token was allowed, goes on as xgrammar's own matcher would."""
    tokenizer, compiler, (bad, good), masks = masks_and_rows(padded_model, ["choice", "regex"], local=False)
    vocab = masks.vocab_size
    logits = torch.zeros(2, vocab)
    masks.finish(masks.start([bad, good])).apply(logits)
    refused = int(torch.isinf(logits[0]).nonzero()[0])
    allowed = int(torch.isfinite(logits[1]).nonzero()[-1])
    bad.token_ids, good.token_ids = [refused], [allowed]
    masks.after_sample([bad, good], [True, True], torch.tensor([refused, allowed]))
    logits = torch.zeros(2, vocab)
    masks.finish(masks.start([bad, good])).apply(logits)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    own = xgr.GrammarMatcher(good.grammar.compiled.result())
    assert own.accept_token(allowed)
    assert torch.equal(logits[1], own_masked_logits(own, vocab))
    masks.close()
    compiler.close()


def test_a_worker_that_died_is_an_error_not_a_hang(padded_model):
    tokenizer, compiler, rows, masks = masks_and_rows(padded_model, ["regex"], local=False)
    masks.finish(masks.start(rows))
    process = compiler.worker.result().process
    process.kill()
    process.wait()
    with pytest.raises(RuntimeError, match=r"the structured-output mask worker exited \(code -9\)"):
        masks.finish(masks.start(rows))
    assert masks.counter_values[MASK_READY] > masks.fills, "a device wait on the dead worker's counter would hang"
    masks.close()
    compiler.close()


def test_the_watch_on_the_worker_releases_the_device_waits_when_it_exits():
    """The thread that watches the worker's process lets the device's waits go on once it has exited (a blocked
    engine would never reach a call that notices), and does nothing for masks already closed."""
    released = []

    class Masks:
        closed = False

        def _release_waits(self):
            released.append(True)
    for closed in (False, True):
        process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        masks = Masks()
        masks.closed = closed
        watch = threading.Thread(target=grammar_mask._release_when_gone, args=(process.pid, weakref.ref(masks)))
        watch.start()
        time.sleep(0.2)
        assert not released, "released while the worker lives"
        process.kill()
        process.wait()
        watch.join(timeout=10)
        assert not watch.is_alive() and released == ([] if closed else [True])
        released.clear()


def test_the_engine_stops_its_mask_worker_and_frees_its_memory_at_exit(padded_model):
    with LLM(padded_model, num_kvcache_blocks=48, max_model_len=1024) as engine:
        engine.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=SPECS["regex"]), use_tqdm=False)
        process = engine.requests.grammars.worker.result().process
        name = engine.model_runner.sampler.grammar_masks.shared.name
    assert process.poll() == 0
    with pytest.raises(FileNotFoundError):
        SharedMemory(name=name)


def test_a_step_interrupted_before_its_sampling_leaves_the_next_calls_masks_right(padded_model):
    """Ctrl-C while a step waits between its mask's start and its sampling (the engine aborts the call): that
    step's answer from the worker is never read, and the next call's steps must not take it for theirs."""
    choices = ["yes", "no", "maybe"]
    with LLM(padded_model, num_kvcache_blocks=48, max_model_len=1024) as llm:
        complete, calls = llm._complete, [0]

        def interrupted(step):
            calls[0] += 1
            if calls[0] == 3:
                raise KeyboardInterrupt
            return complete(step)
        llm._complete = interrupted
        regex = SamplingParams(max_tokens=12, temperature=1.0, structured_outputs=StructuredOutputsParams(
            regex=REGEX))
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["a", "b"], regex, use_tqdm=False)
        llm._complete = complete
        params = [SamplingParams(max_tokens=12, temperature=1.0, seed=i, structured_outputs=StructuredOutputsParams(
            choice=choices)) for i in range(6)]
        outputs = llm.generate(["x", "y", "z", "u", "v", "w"], params, use_tqdm=False)
        assert [o.outputs[0].text in choices for o in outputs] == [True] * 6, [o.outputs[0].text for o in outputs]
        assert_no_leaks(llm)


def test_the_worker_waits_for_the_device_written_tokens_and_ends_when_its_engine_is_gone(padded_model):
    """The device path's hand-over, on the host: a fill ahead waits until the tokens and their counter are written
    (here by a thread, late), takes those tokens, and its masks are xgrammar's own; a worker whose engine is gone
    stops waiting."""
    tokenizer, compiler, rows, masks = masks_and_rows(padded_model, ["regex", "choice"])
    reference = Reference(compiler, rows, tokenizer.eos_token_id)
    worker = masks.worker.worker
    mask = masks.finish(masks.start(rows))
    logits = torch.zeros(len(rows), masks.vocab_size)
    mask.apply(logits)
    tokens = [int(torch.isfinite(row).nonzero()[0]) for row in logits]

    def device() -> None:
        time.sleep(0.3)
        worker.tokens[:len(tokens)] = tokens
        worker.counters[TOKENS_LANDED] = 1
    writer = threading.Thread(target=device)
    writer.start()
    started = time.perf_counter()
    slots = [row.grammar.slot for row in rows]
    worker.ahead([0, 1], slots, masks.turn, 1, None, 0)
    assert time.perf_counter() - started > 0.25, "the fill ahead did not wait for the tokens"
    writer.join()
    masks.generation = 1
    masks.note_ahead(masks.turn, slots, 1)
    for row, token in zip(rows, tokens):
        row.token_ids = [token]
        reference.take(row, token)
    sample_a_step(masks, rows, reference)  # the masks filled ahead from those tokens are xgrammar's own
    assert not worker.errors
    worker.engine_pid = -1  # not this process's parent: its engine is gone
    with pytest.raises(SystemExit, match="the engine is gone"):
        worker.wait(TOKENS_LANDED, 99)
    compiler.close()


@pytest.mark.gpu
def test_gpu_mask_through_pinned_buffers_equals_the_host_mask(padded_model):
    """The device path through the worker's process, step after step (both shared buffers in turn; a constrained
    subset scattered by row, and every row constrained; rows sitting out a step; masks filled ahead after a step's
    sampling once the device wrote its tokens, or at the next start): the logits it masks on the GPU equal
    xgrammar's CPU masking of the same logits."""
    _masks_step_by_step(padded_model, torch.device("cuda"), "process")


class CounterSpin:
    """The device's wait for the worker's counter (sampling/host_wait.py), played by the host: `until` returns once
    the worker has written it, as work queued behind the wait would start."""

    def __init__(self, counters) -> None:
        self.counters = counters

    def until(self, number: int) -> None:
        waited = time.perf_counter()
        while self.counters[MASK_READY] < number:
            assert time.perf_counter() - waited < 30, f"the worker never wrote fill {number}'s counter"


def _masks_step_by_step(padded_model: str, device: torch.device, worker: str) -> None:
    names = [None if i % 3 == 0 else list(SPECS)[i % len(SPECS)] for i in range(9)]
    tokenizer, compiler, rows, masks = masks_and_rows(padded_model, names, local=not worker.startswith("process"),
                                                      device=device, max_rows=16)
    answers_late = "counter" in worker  # the device path's order: the mask read once the counter says it is
    if answers_late:  # written, each step's answer read after the next step's start (when its tokens come back)
        masks.wait = CounterSpin(masks.counter_values)
    previous = None
    if worker.startswith("local"):
        filler = masks.worker.worker.filler
        assert filler.core is not None, "this xgrammar changed the binding accept_binding calls: fast accept off"
        assert filler.fill_binding is not None, "this xgrammar changed the binding fill_binding calls: fast fill off"
        if "public" in worker:
            filler.core = filler.fill_binding = None
    reference = Reference(compiler, rows, tokenizer.eos_token_id)
    generator = torch.Generator().manual_seed(0)
    for step in range(12):
        batch = rows if step % 2 == 0 else [r for r in rows if r.grammar is not None]  # all, then a subset
        if step % 4 == 3:  # some constrained rows sit out a step (a prefill of other requests)
            batch = [r for r in batch if r.seq_id % 2 == 0]
        logits = torch.randn(len(batch), masks.vocab_size, generator=generator)
        number = masks.start(batch)
        if answers_late and previous is not None:
            masks.confirm(previous)
        mask = masks.finish(number)
        on_device = logits.to(device)
        mask.apply(on_device)
        if answers_late:
            previous = number
        else:
            masks.confirm(number)
        expected = torch.stack([reference.masked(row, logits[i]) for i, row in enumerate(batch)])
        assert torch.equal(on_device.cpu(), expected), f"step {step}"
        kept = step % 3 != 2  # every third step's tokens are dropped (a prefill chunk short of its prompt's end)
        sampled = []
        for i, row in enumerate(batch):  # each row takes its best allowed token but the end, as a step would
            scores = expected[i].clone()
            scores[tokenizer.eos_token_id] = -float("inf")
            sampled.append(int(scores.argmax()) if torch.isfinite(scores.max()) else tokenizer.eos_token_id)
            if kept:
                row.token_ids = row.token_ids + [sampled[-1]]
                reference.take(row, sampled[-1])
        masks.after_sample(batch, [kept] * len(batch), torch.tensor(sampled, device=device))
        if worker.startswith("local") and kept:  # each mask filled ahead lies where the engine will look for it
            for row in batch:
                if row.grammar is not None:
                    at, _, _ = masks.worker.worker.constraints[row.grammar.slot].filled
                    buffer = at // masks.layout.span
                    assert at % masks.layout.span == masks.ahead[buffer][row.grammar.slot], f"row {row.seq_id}: {at}"
    assert any(m.is_terminated() for m in reference.matchers.values()), "no row reached its grammar's end"
    masks.close()
    compiler.close()


@pytest.mark.gpu
def test_gpu_the_device_waits_for_a_mask_the_worker_writes_late(padded_model):
    """`finish` returns before the worker has filled the step's masks (here 0.3 s late, from a thread): the device
    waits for the worker's counter before it copies them, so the logits it masks are still xgrammar's own."""
    tokenizer, compiler, rows, masks = masks_and_rows(padded_model, ["regex", "choice", "json"],
                                                      device=torch.device("cuda"))
    assert masks.wait is not None, "no stream wait on this driver: the engine's thread would wait for each mask"
    send = masks.worker.send

    def late(method, *args):
        if method == "fill":
            threading.Timer(0.3, send, (method, *args)).start()
        else:
            send(method, *args)
    masks.worker.send = late
    reference = Reference(compiler, rows, tokenizer.eos_token_id)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        logits = torch.randn(len(rows), masks.vocab_size, generator=generator)
        started = time.perf_counter()
        number = masks.start(rows)
        mask = masks.finish(number)
        assert time.perf_counter() - started < 0.2, "finish waited for the worker's fill"
        on_device = logits.cuda()
        mask.apply(on_device)
        expected = torch.stack([reference.masked(row, logits[i]) for i, row in enumerate(rows)])
        assert torch.equal(on_device.cpu(), expected)
        masks.confirm(number)
        tokens = [int(torch.isfinite(row).nonzero()[-1]) for row in expected]
        for row, token in zip(rows, tokens):
            row.token_ids = row.token_ids + [token]
            reference.take(row, token)
        masks.after_sample(rows, [True] * len(rows), torch.tensor(tokens, device="cuda"))
    masks.close()
    compiler.close()


@pytest.mark.gpu
def test_gpu_a_worker_gone_while_the_device_waits_is_an_error_not_a_hang(padded_model):
    """The worker dies after a step's fill is asked for and its wait queued: reading its answer raises, and the
    device's wait is released (the device synchronizes)."""
    tokenizer, compiler, rows, masks = masks_and_rows(padded_model, ["regex"], local=False,
                                                      device=torch.device("cuda"))
    number = masks.start(rows)
    masks.finish(number)
    masks.confirm(number)
    process = compiler.worker.result().process
    os.kill(process.pid, signal.SIGSTOP)  # it cannot answer the next fill
    number = masks.start(rows)
    masks.finish(number).apply(torch.zeros(1, masks.vocab_size, device="cuda"))
    process.kill()
    process.wait()
    with pytest.raises(RuntimeError, match=r"the structured-output mask worker exited \(code -9\)"):
        masks.confirm(number)
    synchronized = threading.Thread(target=torch.cuda.synchronize, daemon=True)
    synchronized.start()
    synchronized.join(timeout=30)
    assert not synchronized.is_alive(), "the device still waits for the dead worker's mask"
    masks.close()
    compiler.close()


@pytest.mark.gpu
def test_gpu_engine_constrains_its_rows_and_runs_the_free_ones_whole(small_model):
    """CUDA graphs and async scheduling with constrained and free rows in one batch. (Free rows equal to a run
    without the constrained ones is checked on CPU, where logits do not depend on the batch's size.)"""
    prompts = [[1000 + 37 * i + j for j in range(20 + 9 * i)] for i in range(12)]
    free = SamplingParams(temperature=0.7, seed=5, max_tokens=64, ignore_eos=True)
    kinds = list(SPECS)
    params = [free if i % 2 == 0 else SamplingParams(temperature=0.7, seed=i, max_tokens=300,
                                                     structured_outputs=SPECS[kinds[(i // 2) % len(kinds)]])
              for i in range(len(prompts))]
    with LLM(small_model, max_model_len=1024) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 64 for o in outputs[0::2])
        for i, output in enumerate(outputs[1::2]):
            sample = output.outputs[0]
            if sample.finish_reason == "stop":
                check_matches(kinds[i % len(kinds)], sample.text)
            else:
                assert kinds[i % len(kinds)] == "json_object", sample.text
        assert_no_leaks(llm)


@pytest.mark.slow
def test_a_killed_engine_leaves_no_mask_worker_behind(padded_model, tmp_path):
    """kill -9 of the engine's process: its mask worker sees the pipe close and exits."""
    script = tmp_path / "engine.py"
    script.write_text(f"""
from nanovllm import LLM, SamplingParams, StructuredOutputsParams
llm = LLM({padded_model!r}, num_kvcache_blocks=48, max_model_len=1024)
llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a+")),
             use_tqdm=False)
print(llm.requests.grammars.worker.result().process.pid, flush=True)
import time; time.sleep(600)
""")
    engine = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    worker = int(engine.stdout.readline())
    engine.kill()
    engine.wait()
    deadline = time.monotonic() + 20
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker), f"mask worker {worker} outlived its engine"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by init) counts as gone
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
