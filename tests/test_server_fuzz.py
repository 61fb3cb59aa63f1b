"""Schemathesis against the server's own `GET /openapi.json`, sent to a live tiny server: for
every operation its examples, its coverage cases (each field's boundaries, a missing or null
one, a wrong type, a method the path does not take) and generated requests, valid and invalid
(seeded and deterministic, so a run repeats). No answer may be a 5xx; every answer has a status,
content type and body (each event of a stream included) that its route declares; a method the
path does not take is a 405 with the path's methods in `Allow`."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (allow_header_conformance,
                                               content_type_conformance,
                                               response_schema_conformance,
                                               status_code_conformance, unsupported_method)

from server_harness import LiveServer, get, tiny

pytestmark = [pytest.mark.usefixtures("cpu"), pytest.mark.slow]

# Generated requests per operation (schemathesis's fuzzing phase), valid and invalid ones
# together. Its coverage phase (each field's boundaries, missing and null fields, wrong types,
# unexpected methods: about 2,700 of the file's requests) does not depend on this bound.
EXAMPLES = 15
SEED = 41
DEADLINE_MS = 30_000  # one request, generation included, on a slow shared CPU
MAX_TOKENS = 2  # generated tokens per choice: the subject is the protocol, not the model
MAX_CHOICES = 2
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
# Schema-valid requests may still be refused: a schema cannot state every rule across fields
# (a tool_choice naming a tool the request lacks), so positive_data_acceptance is left out.
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, unsupported_method, allow_header_conformance]
OPERATIONS = ["POST /v1/chat/completions", "POST /v1/completions", "POST /v1/messages",
              "POST /v1/messages/count_tokens", "POST /v1/responses",
              "GET /v1/responses/{response_id}", "DELETE /v1/responses/{response_id}",
              "GET /v1/models", "GET /health", "GET /metrics", "POST /api/chat",
              "POST /api/generate", "GET /api/tags", "POST /api/show", "GET /api/ps",
              "GET /api/version"]


@pytest.fixture(scope="module")
def live():
    model, tokenizer = tiny()
    server = LiveServer(model, tokenizer, max_tokens=MAX_TOKENS)
    yield server
    server.close()


@pytest.fixture(scope="module")
def api_schema(live):
    status, spec = get(live.port, "/openapi.json")
    assert status == 200
    config = schemathesis.Config.from_dict({
        "seed": SEED, "base-url": f"http://127.0.0.1:{live.port}",
        "generation": {"max-examples": EXAMPLES, "deterministic": True, "mode": "all"},
        "phases": {"examples": {"enabled": True}, "coverage": {"enabled": True},
                   "fuzzing": {"enabled": True}}})
    return schemathesis.openapi.from_dict(spec, config=config)


schema = schemathesis.pytest.from_fixture("api_schema")


def bounded(case) -> None:
    """Short generations: at most MAX_TOKENS per choice and MAX_CHOICES choices (the schema
    allows any number; the server's own bounds are tested elsewhere)."""
    body = case.body
    if not isinstance(body, dict):
        return
    for key in TOKEN_FIELDS:
        if isinstance(body.get(key), (int, float)) and body[key] > MAX_TOKENS:
            body[key] = MAX_TOKENS
    if isinstance(body.get("n"), (int, float)) and body["n"] > MAX_CHOICES:
        body["n"] = MAX_CHOICES
    options = body.get("options")  # Ollama's num_predict (0 or less: the server's default)
    if isinstance(options, dict) and isinstance(options.get("num_predict"), (int, float)) \
            and options["num_predict"] > MAX_TOKENS:
        options["num_predict"] = MAX_TOKENS


def test_every_operation_is_fuzzed(api_schema):
    assert sorted(op.ok().label for op in api_schema.get_all_operations()) == \
        sorted(OPERATIONS)


@schema.parametrize()
@settings(deadline=DEADLINE_MS)
def test_answers_conform_to_the_schema(case):
    bounded(case)
    case.call_and_validate(checks=CHECKS, timeout=60)
