"""`kvports chat`: turns from a pipe (each line one), the conversation kept, cut to the context with
a notice, /reset and /exit; and on a terminal (a pseudo-terminal) with the real model, three turns
with Ctrl-C stopping an answer halfway and Ctrl-D leaving."""

from __future__ import annotations

import io
import json
import os
import select
import signal
import sys
import time
import warnings

import numpy as np
import pytest

from kvports import generating, loading
from kvports.formats import chat as chat_limits
from kvports.hub import model_path
from kvports.shared.errors import UserError
from tests.helpers.commands import assert_one_error_line, run_cli

NEW_TOKENS = 6


@pytest.fixture
def prompts_seen(monkeypatch):
    """Every conversation chat renders, in order."""
    seen: list[list[dict[str, str]]] = []
    real = loading.chat_ids

    def spy(weights, messages, tokenizer):
        seen.append([dict(message) for message in messages])
        return real(weights, messages, tokenizer)

    monkeypatch.setattr(loading, "chat_ids", spy)
    return seen


def chat(capsys, monkeypatch, model, lines: list[str], *flags: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(line + "\n" for line in lines)))
    return run_cli(capsys, "chat", "--weights", model, "--new-tokens", NEW_TOKENS, "--no-stop", *flags)


def test_each_piped_line_is_a_turn_answered_as_generate_answers_it(capsys, monkeypatch, chat_model):
    code, out, err = chat(capsys, monkeypatch, chat_model, ["hi there", "and then?"])
    assert code == 0, err
    argv = ["generate", "--framework", "numpy", "--mode", "cached", "--weights", chat_model, "--json"]
    code, given, _ = run_cli(capsys, *argv, "--chat", "hi there", "--new-tokens", NEW_TOKENS, "--no-stop")
    assert out.split("\n")[0] == json.loads(given)["answer"][0].rstrip("\ufffd")  # a cut character never shown
    assert err.count("tokens/s") == 2


def test_the_conversation_is_kept_across_turns(capsys, monkeypatch, chat_model, prompts_seen):
    code, out, err = chat(capsys, monkeypatch, chat_model, ["hi", "yes"])
    assert code == 0, err
    answer = out.split("\n")[0]
    assert prompts_seen[-1] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "yes"},
    ]


def test_reset_starts_again_and_exit_leaves(capsys, monkeypatch, chat_model, prompts_seen):
    code, out, err = chat(capsys, monkeypatch, chat_model, ["hi", "/reset", "yes", "/exit", "never read"])
    assert code == 0, err
    assert prompts_seen[-1] == [{"role": "user", "content": "yes"}]
    assert err.count("tokens/s") == 2 and "starts again" in err


def test_the_oldest_turns_are_dropped_to_fit_the_context_with_a_notice(capsys, monkeypatch, chat_model, prompts_seen):
    code, out, err = chat(capsys, monkeypatch, chat_model, ["a", "b", "c", "d"])
    assert code == 0, err
    assert "the context is full (64 tokens): the oldest" in err
    assert err.count("tokens/s") == 4  # every turn answered
    assert prompts_seen[-1][-1] == {"role": "user", "content": "d"} and len(prompts_seen[-1]) < 7


def test_a_message_the_context_cannot_hold_is_refused_and_the_chat_goes_on(capsys, monkeypatch, chat_model):
    code, out, err = chat(capsys, monkeypatch, chat_model, ["x" * 80, "hi"])
    assert code == 0, err
    assert "say less, or lower --new-tokens" in err and err.count("tokens/s") == 1


def test_a_blank_line_is_skipped_and_only_the_end_of_input_ends_the_chat(capsys, monkeypatch, chat_model, prompts_seen):
    code, out, err = chat(capsys, monkeypatch, chat_model, ["hi", "", "   ", "yes"])
    assert code == 0, err
    assert err.count("tokens/s") == 2 and prompts_seen[-1][-1] == {"role": "user", "content": "yes"}


@pytest.mark.parametrize(
    "length",
    [
        3_000,  # past the budget the context used to give the template (2,048 characters here): a notice, not exit 2
        chat_limits.MAX_CONTENT + 1,  # past the content a chat may hold: refused unread by the tokenizer
    ],
)
def test_a_line_too_long_is_a_notice_and_the_chat_goes_on(capsys, monkeypatch, chat_model, prompts_seen, length):
    code, out, err = chat(capsys, monkeypatch, chat_model, [("hi " * length)[:length], "yes"])
    assert code == 0, err
    assert err.count("tokens/s") == 1 and "Traceback" not in err and "say less" in err
    assert prompts_seen[-1] == [{"role": "user", "content": "yes"}]


def test_bytes_that_are_not_utf8_are_read_as_replacement_characters(capsys, monkeypatch, chat_model, prompts_seen):
    piped = io.TextIOWrapper(io.BytesIO(b"\xff\xfehi\n\x00\x01\x80binary\n"), encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", piped)
    code, out, err = run_cli(capsys, "chat", "--weights", chat_model, "--new-tokens", NEW_TOKENS, "--no-stop")
    assert code == 0, err
    assert err.count("tokens/s") == 2
    turns = {message["content"] for prompt in prompts_seen for message in prompt if message["role"] == "user"}
    assert {"\ufffd\ufffdhi", "\x00\x01\ufffdbinary"} <= turns


def test_an_unknown_command_is_a_notice_not_a_message(capsys, monkeypatch, chat_model, prompts_seen):
    code, out, err = chat(capsys, monkeypatch, chat_model, ["/help", "hi"])
    assert code == 0, err
    assert "unknown command '/help'" in err and err.count("tokens/s") == 1
    assert prompts_seen[-1] == [{"role": "user", "content": "hi"}]


def test_a_doubled_slash_sends_a_message_that_starts_with_one(capsys, monkeypatch, chat_model, prompts_seen):
    code, out, err = chat(capsys, monkeypatch, chat_model, ["//etc is a folder"])
    assert code == 0, err
    assert prompts_seen[-1] == [{"role": "user", "content": "/etc is a folder"}]


def test_a_jax_chats_turns_share_one_compiled_shape_and_answer_as_numpy(capsys, monkeypatch, chat_model):
    """Each turn's prompt is longer than the last; left-padded to one shape (`generating.session_shape`,
    here the context less the new tokens) the second turn compiles nothing new."""
    jax_port = pytest.importorskip("kvports.jax_impl.port")
    from tests.helpers.compiles import counting_traces

    answers, traces = [], []
    for lines in (["hi"], ["hi", "yes"]):
        jax_port.clear_compiled()
        with counting_traces() as counted:
            code, out, err = chat(capsys, monkeypatch, chat_model, lines, "--framework", "jax")
        assert code == 0, err
        answers.append(out)
        traces.append(len(counted))
    assert traces[1] == traces[0]
    code, expected, err = chat(capsys, monkeypatch, chat_model, ["hi", "yes"], "--framework", "numpy")
    assert answers[1] == expected


@pytest.mark.parametrize(
    "framework, P, new_tokens, context, width",
    [
        ("jax", 30, 10, 8192, 64),  # at least SHORTEST_SHAPE
        ("jax", 65, 10, 8192, 128),  # the next power of two
        ("jax", 128, 10, 8192, 128),  # already one
        ("jax", 100, 10, 120, 110),  # no further than the context holds with the new tokens
        ("jax", 115, 10, 120, 115),  # never narrower than the prompt (it was checked to fit)
        ("numpy", 30, 10, 8192, 30),  # a port that does not compile per shape: as it is
        ("torch", 30, 10, 8192, 30),
    ],
)
def test_a_sessions_prompt_is_padded_on_the_left_to_a_shared_shape(framework, P, new_tokens, context, width):
    from types import SimpleNamespace

    from kvports.shared.generation import PAD

    loaded = SimpleNamespace(framework=framework, config=SimpleNamespace(max_seq_len=context))
    prompts = np.arange(1, P + 1, dtype=np.int64)[None, :]  # [1, P]
    shaped = generating.session_shape(loaded, prompts, new_tokens)  # type: ignore[arg-type]
    assert shaped.shape == (1, width)
    assert (shaped[:, : width - P] == PAD).all() and np.array_equal(shaped[:, width - P :], prompts)


def test_a_model_without_a_tokenizer_is_one_error_line(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    err = assert_one_error_line(*run_cli(capsys, "chat"))
    assert "kvports chat needs a model with a tokenizer and a chat template" in err


# ---------------------------------------------------------------- a terminal, the real model


class Terminal:
    """The parent's side of a pseudo-terminal: what it has shown, read past a cursor."""

    def __init__(self, fd: int):
        self.fd, self.seen, self.cursor = fd, bytearray(), 0

    def read(self, deadline: float) -> None:
        ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
        chunk = b""
        if ready:
            try:
                chunk = os.read(self.fd, 4096)
            except OSError:  # the child closed the terminal
                pass
        if not chunk:
            raise AssertionError(f"nothing more on the terminal; it showed {bytes(self.seen[self.cursor :])!r}")
        self.seen += chunk

    def expect(self, wanted: bytes, timeout: float = 240.0) -> None:
        """Read until `wanted` shows past the cursor; the cursor moves past it."""
        deadline = time.monotonic() + timeout
        while (found := self.seen.find(wanted, self.cursor)) < 0:
            self.read(deadline)
        self.cursor = found + len(wanted)

    def more(self, count: int, timeout: float = 240.0) -> None:
        """Read until `count` bytes more than the cursor's show."""
        deadline = time.monotonic() + timeout
        while len(self.seen) < self.cursor + count:
            self.read(deadline)


@pytest.mark.slow
def test_three_turns_on_a_terminal_with_ctrl_c_stopping_an_answer(tmp_path):
    import pty

    try:
        model_path("smollm2")
    except UserError:
        pytest.skip("SmolLM2 is not fetched: run make model")
    argv = [sys.executable, "-m", "kvports.cli", "chat", "--model", "smollm2", "--new-tokens", "120", "--threads", "1"]
    with warnings.catch_warnings():  # the child only execs: no lock another thread holds is ever taken
        warnings.simplefilter("ignore", RuntimeWarning)
        pid, fd = pty.fork()
    if pid == 0:  # the child: the chat, on the terminal's far side
        # Ctrl-C as a terminal's foreground job takes it, whatever the suite's own start left: a shell without
        # job control starts a background job (`make test &`) with SIGINT ignored, kept so through exec.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.execv(sys.executable, argv)
    terminal = Terminal(fd)
    try:
        terminal.expect(b"> ")
        os.write(fd, b"What is the capital of France?\n")
        terminal.expect(b"Paris")
        terminal.expect(b"tokens/s")
        terminal.expect(b"> ")
        os.write(fd, b"Write a long story about a dragon who learns to cook.\n")
        terminal.expect(b"cook.\r\n")  # the line as the terminal echoes it
        terminal.more(40)  # a few words into an answer of up to 120 tokens
        os.write(fd, b"\x03")  # Ctrl-C
        terminal.expect(b"stopped:")
        terminal.expect(b"> ")
        os.write(fd, b"Which country is that city in?\n")
        terminal.expect(b"tokens/s")
        terminal.expect(b"> ")
        os.write(fd, b"\x04")  # Ctrl-D
        _, status = os.waitpid(pid, 0)
        pid = 0
        assert os.waitstatus_to_exitcode(status) == 0, bytes(terminal.seen)
        assert b"Traceback" not in terminal.seen
    finally:
        if pid:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        os.close(fd)
