"""The files of `nanovllm run-batch`: reading the JSONL input, the result records, and resuming (the output file
while a run holds and appends to it is output.py).

Resume guarantee: a record counts as written only once its whole line, newline included, is in the output file.
Each record is written with one write() of the line plus its newline, so a kill (even SIGKILL) can leave at most
one torn line, the last, and it has no newline; read_output() finds it and drop_torn() truncates it away before
anything is appended. A line with its newline that is not a record was not torn by a kill, wherever it is. A
killed process loses nothing it wrote (the OS holds it); against an OS crash, records are fsync'ed with the first
write a second or more after the last fsync, and when the run ends, so a crash loses at most the records since
the last fsync, which the next run recomputes.
"""
import json
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import accumulate

from nanovllm.batch.id_set import IdSet, digest
from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput

LOGPROB_FLOOR = -9999.0  # what vLLM reports for -inf, which JSON cannot hold


class LineError(Exception):
    """A request line that gets an error record instead of a result: an OpenAI-style error code and message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def custom_id_of(request: object) -> str | None:
    """The line's custom_id, or None where it has none usable (the line then gets an error record)."""
    if isinstance(request, dict) and isinstance(request.get("custom_id"), str) and request["custom_id"]:
        return request["custom_id"]
    return None


def input_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw bytes) of each non-blank input line, read lazily. Bytes, so that a line that is
    not UTF-8 is that line's error (json.loads decodes it) rather than the end of the run."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if raw.strip():
                yield number, raw


def parse_line(raw: bytes) -> dict:
    """The request object of one line; LineError where it is not JSON, not an object, or has no custom_id."""
    try:
        request = json.loads(raw)
    except (ValueError, RecursionError) as error:  # JSONDecodeError, UnicodeDecodeError, or nesting too deep
        raise LineError("invalid_json", f"not valid JSON: {type(error).__name__}: {error}") from None
    if not isinstance(request, dict):
        raise LineError("invalid_json", f"a request line must be a JSON object, not {type(request).__name__}")
    given = request.get("custom_id")
    if given is not None and not isinstance(given, str):  # OpenAI's batch API takes strings only: say so by name
        raise LineError("invalid_custom_id", f"custom_id must be a string, got {type(given).__name__} {given!r} "
                                             f"(write it in quotes: \"{given}\")")
    if custom_id_of(request) is None:
        raise LineError("missing_custom_id", "the request has no custom_id (a non-empty string)")
    return request


@dataclass
class InputScan:
    """What one pass over the input learns before any work: ids only, never the requests."""

    total: int = 0  # non-blank lines
    ids: IdSet = field(default_factory=IdSet)  # each custom_id once (hashed: the input may hold 10^7)
    duplicates: dict[str, list[int]] = field(default_factory=dict)  # custom_id -> every line number holding it
    id_less_lines: list[int] = field(default_factory=list)  # lines that will get an error record without an id


def _ids_by_line(path: str) -> Iterator[tuple[int, str | None]]:
    for number, raw in input_lines(path):
        try:
            yield number, custom_id_of(json.loads(raw))
        except (ValueError, RecursionError):
            yield number, None


def scan_input(path: str) -> InputScan:
    """One pass for the ids (memory: 16 bytes an id), and a second one only if some id repeats, to name it."""
    scan = InputScan()
    for number, custom_id in _ids_by_line(path):
        scan.total += 1
        if custom_id is None:
            scan.id_less_lines.append(number)
        else:
            scan.ids.add(custom_id)
    repeated = scan.ids.repeated()
    if repeated:
        lines: dict[str, list[int]] = {}
        for number, custom_id in _ids_by_line(path):
            if custom_id is not None and digest(custom_id) in repeated:
                lines.setdefault(custom_id, []).append(number)
        scan.duplicates = {custom_id: numbers for custom_id, numbers in lines.items() if len(numbers) > 1}
    return scan


@dataclass
class Torn:
    """An output's last line that an interrupted write left behind: one without its newline."""

    line: int  # 1-based
    offset: int  # where it starts: the file is truncated to this length before anything is appended
    size: int  # bytes


@dataclass
class Done:
    """What an earlier run already answered: custom_ids, and the line numbers of records that have none."""

    ids: IdSet = field(default_factory=IdSet)
    lines: set[int] = field(default_factory=set)
    torn: Torn | None = None  # a torn last line, still in the file until drop_torn() removes it

    def has(self, custom_id: str | None, line: int) -> bool:
        return custom_id in self.ids if custom_id is not None else line in self.lines


def read_output(path: str) -> Done:
    """What an earlier run wrote to `path`, read without changing it; a missing file is an empty one.

    A last line without its newline is torn (a record's newline is written with it, so no newline means the
    write did not finish), even where its text happens to be valid JSON; drop_torn() removes it once work starts.
    A whole line (newline and all) that is not a JSON record cannot come from a kill, at the end as anywhere
    else, so it is a ValueError rather than data silently thrown away."""
    done = Done()
    if not os.path.exists(path):
        return done
    good_end = 0  # the offset just past the last complete, valid record
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            whole = raw.endswith(b"\n")  # only the file's last line can lack it
            try:
                record = json.loads(raw) if whole else None
            except ValueError:  # JSONDecodeError or UnicodeDecodeError
                record = None
            if raw.strip() and not isinstance(record, dict):
                if whole:
                    raise ValueError(f"{path}: line {number} is not a valid JSON record, and not a torn last write "
                                     f"(that has no newline), so fix or remove that line by hand")
                done.torn = Torn(number, good_end, len(raw))
                break
            good_end += len(raw)
            if isinstance(record, dict):
                if isinstance(record.get("custom_id"), str):
                    done.ids.add(record["custom_id"])
                elif isinstance(record.get("error"), dict) and isinstance(record["error"].get("line"), int):
                    done.lines.add(record["error"]["line"])
    return done


def drop_torn(path: str, torn: Torn) -> None:
    """Truncate the torn last line that read_output() found, so the next record starts on a line of its own."""
    with open(path, "r+b") as f:
        f.truncate(torn.offset)


def success_record(custom_id: str, body: dict) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": uuid.uuid4().hex, "body": body}, "error": None}


def error_record(custom_id: str | None, line: int, code: str, message: str) -> dict:
    error: dict = {"code": code, "message": f"line {line}: {message}"}
    if custom_id is None:  # how a rerun recognises the line as answered
        error["line"] = line
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None, "error": error}


def response_body(output: RequestOutput, chat: bool, model: str, top_logprobs: int | None) -> dict:
    """An OpenAI `chat.completion` or `text_completion` object, one choice per sample."""
    if chat:
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": _chat_logprobs(c, top_logprobs or 0), "finish_reason": c.finish_reason}
                   for c in output.outputs]
    else:
        choices = [{"index": c.index, "text": c.text, "logprobs": _completion_logprobs(c),
                    "finish_reason": c.finish_reason} for c in output.outputs]
    prompt_tokens = len(output.prompt_token_ids)
    completion_tokens = sum(len(c.token_ids) for c in output.outputs)
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def _value(entry: Logprob) -> float:
    return entry.logprob if entry.logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN too


def _by_rank(position: dict[int, Logprob]) -> list[Logprob]:
    return sorted(position.values(), key=lambda e: e.rank)


def _completion_logprobs(c: CompletionOutput) -> dict | None:
    """The completions format: the sampled tokens, their logprobs, and per position the top k plus the sampled."""
    if c.logprobs is None:
        return None
    sampled = [position[token] for position, token in zip(c.logprobs, c.token_ids)]
    tokens = [e.decoded_token or "" for e in sampled]
    return {"tokens": tokens, "token_logprobs": [_value(e) for e in sampled],
            "top_logprobs": [{e.decoded_token or "": _value(e) for e in _by_rank(p)} for p in c.logprobs],
            "text_offset": [0, *accumulate(len(t) for t in tokens)][:len(tokens)]}


def _chat_logprobs(c: CompletionOutput, k: int) -> dict | None:
    """The chat format: per token its text, logprob and UTF-8 bytes, and the k most likely alternatives."""
    if c.logprobs is None:
        return None

    def entry(e: Logprob) -> dict:
        token = e.decoded_token or ""
        return {"token": token, "logprob": _value(e), "bytes": list(token.encode("utf-8"))}

    return {"content": [{**entry(position[token]), "top_logprobs": [entry(e) for e in _by_rank(position)
                                                                     if e.rank <= k]}
                        for position, token in zip(c.logprobs, c.token_ids)]}
