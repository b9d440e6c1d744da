"""Structured output: a request's `response_format` (any JSON object, or JSON that a schema
describes) as the tokens each of its steps may take, through llguidance.

One path for every port: the host walks each constrained row's grammar (llguidance's `LLMatcher`,
fed the tokens the row took), and every step hands the ports a [B, V] mask of the tokens each row
may take next (`RowSampling.allowed`); each port's `sample_rows` sets the rest to -inf before the
one sampling rule, so the three ports, given the same logits, take the same tokens. The mask is
bits the grammar computed, not numbers a port computed: it cannot make the ports differ.

llguidance: a Rust wheel with no dependencies (xgrammar pulls a torch of its own; outlines-core
needs its own vocabulary index built per model), that takes the `tokenizers` JSON a GGUF file's
tokenizer is rebuilt as, and computes a mask in well under a millisecond at a 49k vocabulary.
JSON is asked for compact (no whitespace between tokens), so a grammar never lets a row spend its
tokens on blank space, and a small model's answer ends sooner.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvports.shared.checks import COMMAND_LINE, Names
from kvports.shared.errors import UserError, echo

MAX_SCHEMA_BYTES = 64 << 10  # a schema's JSON text: OpenAI's own strict schemas are far smaller
MAX_NAME = 64  # a json_schema's name, as OpenAI bounds it
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
FORMATS = ("text", "json_object", "json_schema")
ANY_OBJECT = '{"type":"object"}'  # json_object: llguidance's any JSON object
# llguidance's JSON compiler options: compact JSON (see the module's docstring).
COMPILE_OPTIONS = {"whitespace_flexible": False}
INSTALL = "structured output needs llguidance: pip install 'kvports[serve]' (or pip install llguidance)"


class FormatError(UserError):
    """A refused response format: the server names the body's response_format field as the error's param."""


@dataclass(frozen=True)
class ResponseFormat:
    """What a request's answer must be: "json_object" (any JSON object) or "json_schema" (JSON that
    `schema`, its JSON text, describes)."""

    kind: str
    schema: str  # the schema's JSON text, keys sorted (json_object: any object's)
    name: str | None = None  # a json_schema's name, as the client gave it

    @property
    def grammar(self) -> str:
        """llguidance's grammar for it."""
        return llguidance().LLMatcher.grammar_from_json_schema(self.schema, defaults=COMPILE_OPTIONS)


def llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise FormatError(INSTALL) from None
    return llguidance


def json_object() -> ResponseFormat:
    return ResponseFormat("json_object", ANY_OBJECT)


def json_schema(schema: object, name: str | None = None, names: Names = COMMAND_LINE) -> ResponseFormat:
    """A schema (a JSON object) as a response format, bounded: its grammar is checked by `check_format`."""
    label = names.label("response_format")
    if not isinstance(schema, dict):
        raise FormatError(f"the schema in {label} must be a JSON object, got {json_type(schema)}")
    text = json.dumps(schema, sort_keys=True, separators=(",", ":"))
    if len(text.encode("utf-8")) > MAX_SCHEMA_BYTES:
        raise FormatError(
            f"the schema in {label} is {len(text.encode('utf-8'))} bytes of JSON, above {MAX_SCHEMA_BYTES}"
        )
    return ResponseFormat("json_schema", text, name)


def parse_response_format(value: object, names: Names = COMMAND_LINE) -> ResponseFormat | None:
    """OpenAI's `response_format` as a request body gives it: {"type": "text"} (None: free text),
    {"type": "json_object"}, or {"type": "json_schema", "json_schema": {"name", "schema", "strict",
    "description"}}; anything else a UserError naming the field."""
    label = names.label("response_format")
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise FormatError(f"{label} must be an object with a 'type' ({', '.join(FORMATS)}), got {json_type(value)}")
    kind = value["type"]
    if kind not in FORMATS:
        raise FormatError(f"{label} type {echo(kind)[:80]} is not one of {', '.join(FORMATS)}")
    extra = sorted(set(value) - {"type", "json_schema"} if kind == "json_schema" else set(value) - {"type"})
    if extra:
        raise FormatError(f"{label} of type {kind} takes no field {echo(extra[0])[:80]}")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object()
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise FormatError(f"{label} of type json_schema needs 'json_schema': an object with 'name' and 'schema'")
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if unknown:
        raise FormatError(f"{label}: json_schema has an unknown field {echo(unknown[0])[:80]}")
    name = spec.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise FormatError(f"{label}: json_schema 'name' must be 1 to {MAX_NAME} letters, digits, '_' or '-'")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise FormatError(f"{label}: json_schema 'strict' must be true or false, got {json_type(spec['strict'])}")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise FormatError(f"{label}: json_schema 'description' must be a string")
    # No schema: any JSON, as OpenAI takes it; strict changes nothing here, every answer follows its schema.
    return json_schema(spec.get("schema", {}), name, names)


def check_format(response_format: ResponseFormat, names: Names = COMMAND_LINE) -> ResponseFormat:
    """A response format whose schema llguidance compiles, or a UserError naming the field and saying why."""
    problem = llguidance().LLMatcher.validate_grammar(response_format.grammar)
    if problem:
        first = problem.strip().splitlines()[0][:300] if problem.strip() else problem
        raise FormatError(
            f"the schema in {names.label('response_format')} is not one structured output can follow: {first}"
        )
    return response_format


def json_type(value: object) -> str:
    """What a JSON value is, as a refusal names it (the server's bodies too)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


class Grammars:
    """A model's tokenizer as llguidance's (built once: about a second at a 49k vocabulary), and a
    matcher per constrained request."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: tuple[int, ...] = ()):
        # The model's vocabulary, not the tokenizer's: a mask covers every logit (ids the tokenizer
        # lacks are never allowed); the end-of-turn ids are what a finished grammar allows.
        self.source, self.vocab_size, self.eos_ids = tokenizer, vocab_size, [int(token) for token in eos_ids]
        self.tokenizer: Any = None  # built by the first request that needs it: a server without one starts sooner

    def matcher(self, response_format: ResponseFormat) -> Matcher:
        llg = llguidance()
        if self.tokenizer is None:
            self.tokenizer = llg.LLTokenizer(
                self.source.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_ids or None
            )
        return Matcher(llg.LLMatcher(self.tokenizer, response_format.grammar), self.vocab_size)


class Matcher:
    """One row's place in its grammar: the tokens it may take next, and each token it took."""

    def __init__(self, matcher: Any, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size
        if matcher.is_error():
            raise FormatError(
                f"response_format's schema is not one structured output can follow: {matcher.get_error()}"
            )

    def allowed(self) -> np.ndarray:
        """[V] bool: the tokens the grammar lets the row take next."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)  # [ceil(V / 32) * 4]
        allowed = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)  # [V]
        if not allowed.any():  # never seen: a grammar always allows a token or its end
            raise RuntimeError(f"the grammar allows no token ({self.matcher.get_error() or 'no error given'})")
        return allowed

    def take(self, token: int) -> bool:
        """Feed the token the row took; whether its answer is complete (the grammar takes nothing more)."""
        self.matcher.consume_token(int(token))
        return bool(self.matcher.is_stopped())


def allowed_rows(matchers: list[Matcher | None], vocab_size: int) -> np.ndarray | None:
    """[B, V] bool: each constrained row's allowed tokens, every token for the others; None when no
    row is constrained (the ports' unmasked program)."""
    if all(matcher is None for matcher in matchers):
        return None
    allowed = np.ones((len(matchers), vocab_size), dtype=bool)  # [B, V]
    for row, matcher in enumerate(matchers):
        if matcher is not None:
            allowed[row] = matcher.allowed()
    return allowed
