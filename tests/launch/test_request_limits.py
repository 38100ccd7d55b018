"""No request can stall others: grammar sizes, the grammar compile budget, the body size and request chat
templates each have a limit that answers a 4xx naming it, and large grammars compile off the engine's loop."""

import contextlib
import json
import random
import string
import threading
import time
from http.client import HTTPConnection

import openai
import pytest

from shardserve.runtime.core.structured_output import (MAX_CHOICE_CHARS, MAX_CHOICES, MAX_GRAMMAR_CHARS, MAX_REGEX_CHARS,
                                                  MAX_SCHEMA_CHARS, MAX_SCHEMA_DEPTH, QUICK_GRAMMAR_CHARS)
from tests.launch.conftest import MODEL, http, serving

pytestmark = pytest.mark.slow  # every test here starts a process

STRICT_BODY_BYTES = 65536
MESSAGES = [{"role": "user", "content": "hello world"}]
# a stream's longest wait for a token, as a share of the work it must not wait for (measured in the same run: a
# grammar's compile, a text's tokenizing); a few ms on an idle machine, the whole of that work if it waited
MAX_GAP_SHARE = 0.4
BRIEF_BUDGET = 0.25  # seconds: a schema of 700 optional fields takes about 0.8 s to compile on an idle core


@pytest.fixture(scope="module")
def server():
    """The demo's defaults, and request chat templates allowed."""
    yield from serving("--profile", "demo", "--trust-request-chat-template")


@pytest.fixture(scope="module")
def strict_server():
    """Small limits; request chat templates refused (the default)."""
    yield from serving("--profile", "demo", "--max-request-body-bytes", str(STRICT_BODY_BYTES),
                       "--grammar-compile-timeout", "0.001")


@pytest.fixture(scope="module")
def brief_server():
    """A compile budget shorter than a large schema's compile, longer than a short choice's."""
    yield from serving("--profile", "demo", "--grammar-compile-timeout", str(BRIEF_BUDGET))


def post(url: str, path: str, body: dict, timeout: float = 120.0) -> tuple[int, dict]:
    status, text = http(f"{url}{path}", body, timeout=timeout)
    return status, json.loads(text) if text else {}


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


def random_choices(seed: int, count: int, length: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(string.ascii_lowercase) for _ in range(length)) for _ in range(count)]


def named_tool(parameters: dict) -> dict:
    """A named tool call (the demo's template renders no tools: the request brings one that reads them)."""
    return {"tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
            "chat_template": "{% if tools %}{% endif %}{{ messages[0].content }}"}


OVER_A_LIMIT = {  # field: (what the request adds, the limit the answer names)
    "choices": ("guided_choice", {"guided_choice": [f"c{i}" for i in range(MAX_CHOICES + 1)]}, MAX_CHOICES),
    "choice characters": ("guided_choice", {"guided_choice": ["x" * 1000] * (MAX_CHOICE_CHARS // 1000 + 1)},
                          MAX_CHOICE_CHARS),
    "regex": ("guided_regex", {"guided_regex": "a" * (MAX_REGEX_CHARS + 1)}, MAX_REGEX_CHARS),
    "grammar": ("guided_grammar", {"guided_grammar": 'root ::= "' + "a" * MAX_GRAMMAR_CHARS + '"'},
                MAX_GRAMMAR_CHARS),
    "schema characters": ("guided_json", {"guided_json": {"type": "string", "description": "x" * MAX_SCHEMA_CHARS}},
                          MAX_SCHEMA_CHARS),
    "schema depth": ("guided_json", {"guided_json": nested_schema(MAX_SCHEMA_DEPTH + 1)}, MAX_SCHEMA_DEPTH),
    "response_format": ("response_format", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "deep", "schema": nested_schema(MAX_SCHEMA_DEPTH + 1)}}}, MAX_SCHEMA_DEPTH),
    "tool_choice": ("tool_choice", named_tool({"type": "object", "description": "x" * MAX_SCHEMA_CHARS}),
                    MAX_SCHEMA_CHARS),
}


@pytest.mark.parametrize("case", OVER_A_LIMIT)
def test_a_grammar_over_a_size_limit_is_a_400_naming_the_field_and_the_limit(server, case):
    field, extra, limit = OVER_A_LIMIT[case]
    status, body = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, **extra})
    assert status == 400, body
    assert body["error"]["param"] == field
    assert f"at most {limit} " in body["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_over_the_compile_budget_is_a_400_naming_the_field_and_the_flag(strict_server, stream):
    """The budget is 1 ms here: a grammar of 300 choices takes tens of ms. Streamed or not, the 400 comes
    as the status, before any event."""
    choices = random_choices(seed=int(stream), count=300, length=32)
    status, body = http(f"{strict_server}/v1/completions", {"prompt": "The", "max_tokens": 4, "stream": stream,
                                                            "guided_choice": choices})
    assert status == 400, body
    error = json.loads(body)["error"]
    assert error["param"] == "guided_choice" and "--grammar-compile-timeout" in error["message"]


def large_schema(seed: int) -> dict:
    """A JSON schema just under MAX_SCHEMA_CHARS: 1,400 fields, each one of three strings (~0.5 s to compile
    on an idle core)."""
    fields = {f"field_{seed}_{i}": {"type": "string", "enum": [f"v{i}_{j}" for j in range(3)]} for i in range(1400)}
    schema = {"type": "object", "properties": fields, "required": sorted(fields)}
    assert MAX_SCHEMA_CHARS * 0.9 < len(json.dumps(schema)) <= MAX_SCHEMA_CHARS
    return schema


def test_the_compile_budget_counts_a_grammars_own_compile_not_its_wait_for_a_thread(brief_server):
    """200 choices (over the quick lane's size, tens of ms to compile) arrive while a schema of 700 optional fields
    compiles in the large lane (one thread on two cores): they wait past the budget, and still run, as only their
    own compile counts. The schema, over the budget, is a 400 naming the flag (its compile finishes in the engine's
    process, off the engine's loop)."""
    answers: dict[str, tuple[int, dict]] = {}
    choices = random_choices(seed=5, count=200, length=25)
    assert sum(map(len, choices)) > QUICK_GRAMMAR_CHARS

    def ask(name: str, extra: dict) -> None:
        answers[name] = post(brief_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, **extra})

    schema = threading.Thread(target=ask, args=("schema", {"guided_json": optional_fields_schema(7)}))
    schema.start()
    time.sleep(BRIEF_BUDGET + 0.05)  # the schema compiles; its budget is spent
    ask("choice", {"guided_choice": choices})
    schema.join()
    status, body = answers["schema"]
    assert status == 400 and body["error"]["param"] == "guided_json", body
    assert "--grammar-compile-timeout" in body["error"]["message"]
    status, body = answers["choice"]
    assert status == 200, body
    content = body["choices"][0]["message"]["content"]  # (cut by max_tokens)
    assert any(choice.startswith(content) for choice in choices), content


def optional_fields_schema(seed: int) -> dict:
    """A JSON schema of 700 optional fields: read in a few ms (the API checks it at once), compiled in about
    0.8 s on an idle core (its compile grows faster than its size)."""
    return {"type": "object", "properties": {f"f{seed}_{i}": {"type": "string"} for i in range(700)}}


def test_a_small_grammar_never_waits_behind_large_ones(server):
    """Two schemas of 700 optional fields compile (one after the other: the large lane has one thread on two
    cores) when a choice of two words arrives: it compiles in the quick lane, so it is answered in a small share
    of the time the schemas take (in the same lane, it waited for both)."""
    answers: dict[str, tuple[int, dict, float]] = {}

    def ask(name: str, extra: dict) -> None:
        began = time.monotonic()
        status, body = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, **extra})
        answers[name] = (status, body, time.monotonic() - began)

    schemas = [threading.Thread(target=ask, args=(f"schema{k}", {"guided_json": optional_fields_schema(20 + k)}))
               for k in range(2)]
    for thread in schemas:
        thread.start()
    time.sleep(0.1)  # both are in the engine's process, the first compiling
    ask("choice", {"guided_choice": ["yes", "no"]})
    for thread in schemas:
        thread.join()
    assert all(status == 200 for status, _, _ in answers.values()), answers
    quickest = min(seconds for name, (_, _, seconds) in answers.items() if name != "choice")
    assert answers["choice"][2] < MAX_GAP_SHARE * quickest, \
        f"a two-word choice took {answers['choice'][2]:.2f} s beside schemas that took {quickest:.2f} s at least"


def stream_gaps(url: str, done: threading.Event) -> list[float]:
    """Streams one after another until `done`: each wait for a token (the first one's from the request)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    gaps: list[float] = []
    while not done.is_set():
        last = time.monotonic()
        for _ in client.completions.create(model=MODEL, prompt="The function", max_tokens=200, stream=True,
                                           extra_body={"ignore_eos": True}):
            now = time.monotonic()
            gaps.append(now - last)
            last = now
    return gaps


@contextlib.contextmanager
def streams_alongside(url: str):
    """Streams run (stream_gaps) while the body of the with-block does its work; the list it yields holds
    their waits for a token once the block has ended."""
    done, gaps = threading.Event(), []
    streaming = threading.Thread(target=lambda: gaps.extend(stream_gaps(url, done)))
    streaming.start()
    time.sleep(0.5)  # under way
    try:
        yield gaps
    finally:
        done.set()
        streaming.join()


@pytest.mark.serial
def test_other_streams_keep_their_pace_while_large_grammars_compile(server):
    """Four grammars just under the size limit arrive while streams run: they compile off the engine's
    loop, so no stream waits for them (compiled in a step, they held every stream for seconds: as long as
    a grammar request takes, at least)."""
    answers: list[tuple[int, dict, float]] = []

    def ask(k: int) -> None:
        began = time.monotonic()
        status, body = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8,
                                                             "guided_json": large_schema(k)})
        answers.append((status, body, time.monotonic() - began))

    requests = [threading.Thread(target=ask, args=(k,)) for k in range(4)]
    with streams_alongside(server) as gaps:
        for thread in requests:
            thread.start()
        for thread in requests:
            thread.join()
    assert [status for status, _, _ in answers] == [200] * 4, answers
    assert all(body["choices"][0]["message"]["content"].startswith('{"field_') for _, body, _ in answers), answers
    quickest = min(seconds for _, _, seconds in answers)
    assert max(gaps) < MAX_GAP_SHARE * quickest, \
        f"a stream waited {max(gaps):.2f} s for a token while grammars compiled (the quickest took {quickest:.2f} s)"


@pytest.mark.serial
def test_other_streams_keep_their_pace_while_a_large_text_is_tokenized(server):
    """/tokenize counts any text under the body limit; 10 MB takes seconds to tokenize, off the event loop
    (on it, every stream waited that long for its next token)."""
    text = "The function returns a value. " * 350_000
    with streams_alongside(server) as gaps:
        began = time.monotonic()
        status, body = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False})
        seconds = time.monotonic() - began
    assert status == 200 and body["count"] > len(text) // 10, body.get("error")
    assert max(gaps) < MAX_GAP_SHARE * seconds, \
        f"a stream waited {max(gaps):.2f} s for a token while a text was tokenized (in {seconds:.2f} s)"


@pytest.mark.serial
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_other_streams_keep_their_pace_while_a_large_body_is_read(server, path):
    """15 MB of token ids (under the body limit, over the context: a 400 once read): the body is read and checked
    off the event loop (FastAPI's own reading held every stream and /health for seconds)."""
    ids = list(range(1000, 3500)) * 1000  # 2.5 million ids, about 15 MB of JSON
    body = {"prompt": ids} if path == "/v1/completions" else {"messages": [{"role": "user", "content": ids}]}
    with streams_alongside(server) as gaps:
        began = time.monotonic()
        status, answer = post(server, path, body | {"max_tokens": 2})
        seconds = time.monotonic() - began
    assert status == 400, answer
    assert max(gaps) < MAX_GAP_SHARE * seconds, \
        f"a stream waited {max(gaps):.2f} s for a token while a body was read (in {seconds:.2f} s)"


@pytest.mark.serial
def test_a_body_over_the_limit_is_a_413_before_it_is_parsed(server):
    """The default limit is 16 MiB; a 17 MB body is refused unparsed (today's 10 MB one took seconds)."""
    began = time.monotonic()
    status, body = post(server, "/v1/completions", {"prompt": "x" * 17_000_000, "max_tokens": 4})
    assert status == 413, body
    assert body["error"]["code"] == 413 and "--max-request-body-bytes" in body["error"]["message"]
    assert str(16 << 20) in body["error"]["message"]
    assert time.monotonic() - began < 5


def send_chunked(url: str, payload: bytes) -> tuple[int, dict]:
    """A POST whose body comes in chunks, with no Content-Length."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    connection = HTTPConnection(host, int(port), timeout=60)
    pieces = (payload[i:i + 4096] for i in range(0, len(payload), 4096))
    connection.request("POST", "/v1/completions", body=pieces, headers={"content-type": "application/json"},
                       encode_chunked=True)
    response = connection.getresponse()
    return response.status, json.loads(response.read())


def test_a_chunked_body_is_held_to_the_limit_too(strict_server):
    small = json.dumps({"prompt": "The", "max_tokens": 2}).encode()
    assert send_chunked(strict_server, small)[0] == 200
    status, body = send_chunked(strict_server, json.dumps({"prompt": "x" * STRICT_BODY_BYTES}).encode())
    assert status == 413 and f"larger than {STRICT_BODY_BYTES} bytes" in body["error"]["message"]


@pytest.mark.serial
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_prompt_too_long_for_max_model_len_is_refused_untokenized(server, path):
    """10 MB of text cannot fit the demo's 1,024 tokens: refused by its length, in well under the seconds
    tokenizing it takes."""
    text = "x" * 10_000_000
    request = {"prompt": text} if path == "/v1/completions" else {"messages": [{"role": "user", "content": text}]}
    began = time.monotonic()
    status, body = post(server, path, {**request, "max_tokens": 4})
    assert status == 400, body
    assert body["error"]["param"] == ("prompt" if path == "/v1/completions" else "messages")
    assert "characters, so more than max_model_len=1024 tokens" in body["error"]["message"]
    assert time.monotonic() - began < 2.5


def request_template(field: str, template: str) -> dict:
    """A request's own chat template, given in `field` (vLLM takes both)."""
    return {"chat_template": template} if field == "chat_template" else {"chat_template_kwargs": {
        "chat_template": template}}


@pytest.mark.parametrize("field", ["chat_template_kwargs.chat_template", "chat_template"])
def test_a_request_chat_template_needs_the_operators_flag(strict_server, field):
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    extra = request_template(field, template)
    status, body = post(strict_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, **extra})
    assert status == 400, body
    assert body["error"]["param"] == field and "--trust-request-chat-template" in body["error"]["message"]


@pytest.mark.parametrize("field", ["chat_template_kwargs", "chat_template"])
def test_with_the_flag_a_request_chat_template_is_used(server, field):
    """The bare content as the prompt: as many tokens as the text alone, fewer than the model's template."""
    template = "{{ messages[0].content }}"
    extra = request_template(field, template)
    status, own = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, **extra})
    assert status == 200, own
    _, plain = post(server, "/tokenize", {"prompt": "hello world", "add_special_tokens": False})
    _, templated = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
    assert own["usage"]["prompt_tokens"] == plain["count"] < templated["usage"]["prompt_tokens"]
