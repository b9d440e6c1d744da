"""Round four of the command line: one thread count for every framework (--threads), each
step's log-probabilities (--logprobs), compare's --frameworks/--modes and its speculative
rows, and batch requests that are chats ("messages", in a GGUF file's own template)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
from scipy.special import log_softmax

from kvports import run
from kvports.formats.chat import chat_ids
from kvports.formats.gguf.tokenizer import gguf_tokenizer
from kvports.registry import PORTS
from kvports.shared.generation import GenerationConfig
from kvports.threads import max_threads
from tests.helpers.commands import assert_one_error_line, run_cli
from tests.helpers.gguf_files import write_gguf
from tests.helpers.models import SEED_PROMPT
from tests.helpers.ports import port_or_skip

SEED = SEED_PROMPT[0].tolist()


@pytest.fixture
def no_threads_change(monkeypatch):
    """An in-process command asked for --threads leaves the test process's threads as they were."""
    from kvports import threads

    monkeypatch.setattr(threads, "use_threads", lambda count: None)
    for module in ("kvports.commands.generate_command", "kvports.commands.compare"):
        monkeypatch.setattr(f"{module}.use_threads", lambda count: None)


# ---------------------------------------------------------------- --threads

THREAD_COMMANDS = {
    **{f"generate_{name}": ["generate", "--framework", name, "--mode", "cached"] for name in PORTS},
    "compare": ["compare"],
    "bench": ["bench"],
    "batch": ["batch", "--requests", "absent.jsonl"],
    "batch_bench": ["batch", "--bench"],
}


@pytest.mark.parametrize("value, limit", [("0", "is below 1"), ("1000000", f"is above {max_threads()}")])
@pytest.mark.parametrize("command", sorted(THREAD_COMMANDS))
def test_threads_out_of_range_is_one_error_line_before_any_port_loads(capsys, no_port_may_load, command, value, limit):
    err = assert_one_error_line(*run_cli(capsys, *THREAD_COMMANDS[command], "--threads", value))
    assert err == f"error: --threads {value} {limit}\n"


# What each framework reports as its thread count, after `kvports generate --threads 2` in the same process.
REPORTED = {
    "torch": "import torch; print(torch.get_num_threads(), torch.get_num_interop_threads())",
    "numpy": "import threadpoolctl; print(*sorted({p['num_threads'] for p in threadpoolctl.threadpool_info()}))",
    "jax": "import os; print(os.environ['NPROC'], os.environ['NPROC'])",  # read by XLA's CPU client as it starts
}
EXPECTED = {"torch": "2 2", "numpy": "2", "jax": "2 2"}


def test_threads_reach_the_framework(port):
    name = port.NAME
    script = (
        "from kvports.cli import main; "
        f"assert main(['generate', '--framework', '{name}', '--mode', 'cached', '--new-tokens', '2', '--threads', '2'])"
        f" == 0; {REPORTED[name]}"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == EXPECTED[name]


def test_generate_json_and_compare_title_show_the_thread_count(capsys, no_threads_change):
    code, out, err = run_cli(capsys, "generate", "--framework", "numpy", "--mode", "cached", "--threads", "1", "--json")
    assert code == 0, err
    assert json.loads(out)["threads"] == 1
    code, out, err = run_cli(capsys, "compare", "--frameworks", "numpy", "--repeats", "1", "--threads", "3")
    assert code == 0, err
    assert "3 threads;" in " ".join(out.split())


# ---------------------------------------------------------------- --logprobs


def test_logprobs_are_each_steps_log_softmax_of_the_logits(port, seed_weights):
    config, tensors = seed_weights
    loaded = run.load_model(port.NAME, config, tensors, "float32", "cpu")
    inputs = run.RunInputs(port.NAME, "cached", GenerationConfig(6, stop_ids=()), logprobs=3)
    prompts = run.check_inputs(inputs, config, [SEED, SEED[:3]])
    result = run.generate(loaded, prompts, inputs, return_logits=True)
    assert result.logits is not None and result.logprobs is not None
    expected = log_softmax(result.logits.astype(np.float64), axis=-1)  # [B, N, V]
    for row, (steps, generated) in enumerate(zip(result.logprobs, result.generated, strict=True)):
        assert [step["token"] for step in steps] == generated
        for index, step in enumerate(steps):
            assert step["logprob"] == pytest.approx(expected[row, index, step["token"]], abs=1e-9)
            top = np.argsort(-expected[row, index], kind="stable")[:3]
            assert [alternative["token"] for alternative in step["top"]] == top.tolist()
            assert [a["logprob"] for a in step["top"]] == pytest.approx(expected[row, index, top], abs=1e-9)


def test_logprobs_end_at_a_rows_stop(seed_weights):
    config, tensors = seed_weights
    loaded = run.load_model("numpy", config, tensors, "float32", "cpu")
    inputs = run.RunInputs("numpy", "cached", GenerationConfig(6, stop_ids=(221,)), logprobs=1)
    result = run.generate(loaded, run.check_inputs(inputs, config, [SEED]), inputs)
    assert [step["token"] for step in result.logprobs[0]] == [315, 391, 221]  # the stop token is the last


def test_logprobs_printed_are_the_same_in_every_port(capsys):
    printed = {}
    for name in PORTS:
        port_or_skip(name)
        argv = ["generate", "--framework", name, "--mode", "naive", "--new-tokens", "5", "--logprobs", "4"]
        code, out, err = run_cli(capsys, *argv)
        assert code == 0, err
        printed[name] = [line for line in out.splitlines() if line.lstrip().startswith("step")]
    assert len(printed["torch"]) == 5
    assert printed["torch"][0].split()[:4] == ["step", "0", "315", "-4.2828"]
    assert all(lines == printed["torch"] for lines in printed.values())


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--mode", "cached", "--logprobs", "21"], "error: --logprobs 21 is above 20\n"),
        (["--mode", "cached", "--logprobs", "-1"], "error: --logprobs -1 is below 0\n"),
        (
            ["--mode", "speculative", "--draft", "ngram", "--logprobs", "2"],
            "error: --logprobs 2 needs --mode naive or cached: speculative decoding verifies proposals in rounds "
            "and keeps no step's logits\n",
        ),
    ],
)
@pytest.mark.parametrize("framework", PORTS)
def test_logprobs_out_of_bounds_is_one_error_line(capsys, no_port_may_load, framework, argv, expected):
    assert assert_one_error_line(*run_cli(capsys, "generate", "--framework", framework, *argv)) == expected


def test_logprobs_are_bounded_by_the_vocabulary(seed_weights):
    config, _ = seed_weights
    inputs = run.RunInputs("numpy", "cached", GenerationConfig(2), logprobs=20)
    small = dataclasses.replace(config, vocab_size=8)
    with pytest.raises(run.UserError, match="--logprobs 20 is above 8"):
        run.check_inputs(inputs, small, [[1, 2]])


# ---------------------------------------------------------------- compare --frameworks / --modes


def compare_json(capsys, *argv: str) -> dict:
    code, out, err = run_cli(capsys, "compare", "--json", "--repeats", "1", "--new-tokens", "6", *argv)
    assert code == 0, err
    return json.loads(out)


def test_compare_runs_only_the_frameworks_and_modes_asked(capsys):
    result = compare_json(capsys, "--frameworks", "numpy", "--modes", "cached")
    assert [(row["framework"], row["mode"]) for row in result["rows"]] == [("numpy", "cached")]
    assert result["reference"] == "numpy cached"


def test_compare_speculative_rows_are_held_to_cached_with_their_acceptance(capsys):
    result = compare_json(capsys, "--frameworks", "numpy", "--modes", "cached,speculative", "--draft", "ngram")
    cached, speculative = result["rows"]
    assert speculative["agree"] and speculative["mode"] == "speculative"
    assert speculative["speculative_speedup"] == pytest.approx(cached["seconds"] / speculative["seconds"])
    assert 0 <= speculative["speculative"]["acceptance_rate"] <= 1
    code, out, err = run_cli(capsys, "compare", "--frameworks", "numpy", "--draft", "ngram", "--repeats", "1")
    assert code == 0, err
    assert "draft kept: the draft's proposals the target accepted" in " ".join(out.split())


def test_compare_title_counts_ragged_prompts_and_one_run(capsys):
    argv = ["compare", "--frameworks", "numpy", "--repeats", "1", "--prompt", "1,2,3", "--prompt", "4,5,6,7,8"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    words = " ".join(out.split())
    assert "2 prompts of 3-5 tokens" in words
    assert "median of 1 run of" in words


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            ["--modes", "speculative"],
            "error: --modes speculative needs --draft FILE (a smaller model) or --draft ngram\n",
        ),
        (
            ["--modes", "speculative", "--draft", "ngram"],
            "error: --modes 'speculative' needs naive or cached too: the reference is a run with logits\n",
        ),
        (["--frameworks", "tensorflow"], "error: unknown framework 'tensorflow'; known: torch, jax, numpy\n"),
    ],
)
def test_compare_modes_and_frameworks_refused_in_one_line(capsys, no_port_may_load, argv, expected):
    assert assert_one_error_line(*run_cli(capsys, "compare", *argv)) == expected


# ---------------------------------------------------------------- batch "messages"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("chat") / "tiny.gguf", "F32")


def run_batch(capsys, model, tmp_path, lines: list) -> tuple[int, list[dict], str]:
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    argv = ["batch", "--framework", "numpy", "--weights", model, "--requests", requests, "--new-tokens", "3"]
    code, out, err = run_cli(capsys, *argv)
    return code, [json.loads(line) for line in out.splitlines()], err


def test_a_messages_request_is_the_chat_generate_renders(capsys, chat_model, tmp_path):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    code, lines, err = run_batch(capsys, chat_model, tmp_path, [{"id": "chat", "messages": messages}])
    assert code == 0, err
    chat_file = tmp_path / "chat.json"
    chat_file.write_text(json.dumps(messages))
    argv = ["generate", "--framework", "numpy", "--mode", "cached", "--weights", chat_model, "--json"]
    code, out, err = run_cli(capsys, *argv, "--chat-file", chat_file, "--new-tokens", "3")
    assert code == 0, err
    alone = json.loads(out)
    prompt = chat_ids(chat_model, messages, gguf_tokenizer(chat_model))
    assert lines[0]["prompt_tokens"] == len(prompt)
    assert alone["tokens"][0] == prompt + lines[0]["tokens"]


BAD_MESSAGES = [
    ({"messages": "hello"}, "'messages' must hold a non-empty JSON list"),
    ({"messages": []}, "'messages' must hold a non-empty JSON list"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "message 0 has role 'robot'"),
    ({"messages": [{"role": "user"}]}, "message 0 is"),
    ({"messages": [{"role": "user", "content": "hi"}], "prompt": [1]}, "give exactly one of 'prompt'"),
    ({"messages": [{"role": "user", "content": "x" * (2**20 + 1)}]}, "above 1048576"),
]


def test_bad_messages_lines_are_one_error_each_and_the_rest_run(capsys, chat_model, tmp_path):
    good = {"id": "good", "messages": [{"role": "user", "content": "hi"}]}
    code, lines, err = run_batch(capsys, chat_model, tmp_path, [line for line, _ in BAD_MESSAGES] + [good])
    assert code == 2
    assert [line["id"] for line in lines[:-1]] == ["good"]
    errors = err.splitlines()
    assert len(errors) == len(BAD_MESSAGES)
    for number, (error, (_, words)) in enumerate(zip(errors, BAD_MESSAGES, strict=True), start=1):
        assert error.startswith(f"error: line {number}: ") and words in error, error


def test_messages_without_a_gguf_file_say_what_they_need(capsys, tmp_path):
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n" + '{"prompt": [1]}\n')
    code, out, err = run_cli(capsys, "batch", "--framework", "numpy", "--requests", requests, "--new-tokens", "2")
    assert code == 2
    assert err.splitlines()[0] == (
        "error: line 1: 'messages' renders a GGUF file's chat template: give --model NAME or --weights FILE.gguf"
    )


# ---------------------------------------------------------------- another model's --weights


@pytest.mark.parametrize("command", ["generate", "compare"])
def test_the_seeds_default_prompt_outside_another_vocabulary_says_to_give_a_prompt(
    capsys, no_port_may_load, tmp_path, command
):
    from kvports.formats.weights import gpt2_init_weights, save_weights
    from tests.helpers.models import TINY_FAMILIES

    config = TINY_FAMILIES["gpt2"]  # a vocabulary of 64
    weights = tmp_path / "tiny.safetensors"
    save_weights(weights, gpt2_init_weights(config), config)
    argv = [command, "--weights", weights] + (["--framework", "numpy", "--mode", "cached"] * (command == "generate"))
    err = assert_one_error_line(*run_cli(capsys, *argv))
    assert err.endswith(f"outside this model's vocabulary [0, {config.vocab_size}): give --prompt IDS or --text TEXT\n")


@pytest.mark.parametrize("given", ["folder", "its model.safetensors"])
def test_a_hugging_face_checkpoint_as_weights_says_to_convert_it(capsys, no_port_may_load, tmp_path, given):
    from tests.helpers.hf_files import llama_config, llama_tensors, write_hf_dir

    config = llama_config()
    folder = write_hf_dir(tmp_path / "hf", config, llama_tensors(config))
    path = folder if given == "folder" else folder / "model.safetensors"
    argv = ["generate", "--framework", "numpy", "--mode", "cached", "--weights", path]
    err = assert_one_error_line(*run_cli(capsys, *argv))
    assert f"convert it once with kvports convert --from-hf '{folder}' --out model.safetensors" in err


# ---------------------------------------------------------------- --prompt-file and --text-file


def test_a_prompt_file_gives_the_tokens_of_the_same_prompts_as_flags(capsys, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1,2,3\n\n4 5 6 7\r\n")  # a blank line skipped, ids by commas or spaces, CRLF
    common = ["generate", "--framework", "numpy", "--mode", "cached", "--new-tokens", "3", "--json"]
    outputs = [
        run_cli(capsys, *common, *extra)[1]
        for extra in (["--prompt-file", prompts], ["--prompt", "1,2,3", "--prompt", "4,5,6,7"])
    ]
    assert json.loads(outputs[0])["tokens"] == json.loads(outputs[1])["tokens"]


def test_each_bad_line_of_a_prompt_file_is_its_own_error_line(capsys, no_port_may_load, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1,2,3\nx 1\n4\n1,-\n")
    code, out, err = run_cli(capsys, "generate", "--framework", "numpy", "--mode", "cached", "--prompt-file", prompts)
    assert (code, out) == (2, "")
    assert err == (
        "error: --prompt-file line 2: prompt token 'x' is not an integer\n"
        "error: --prompt-file line 4: prompt token '-' is not an integer\n"
    )


def test_a_text_file_from_stdin_is_one_prompt_a_line(capsys, chat_model, monkeypatch):
    import io

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hello world\nhi\n")))
    common = ["generate", "--framework", "numpy", "--mode", "cached", "--weights", chat_model, "--json"]
    code, out, err = run_cli(capsys, *common, "--text-file", "-", "--new-tokens", "2")
    assert code == 0, err
    code, expected, err = run_cli(capsys, *common, "--text", "hello world", "--text", "hi", "--new-tokens", "2")
    assert json.loads(out)["tokens"] == json.loads(expected)["tokens"]


@pytest.mark.parametrize(
    "content, words",
    [
        (b"\n\n", "has no line to run"),
        (b"\xff\xfe", "is not UTF-8 text"),
        (b"1," * (2**23 + 1), "holds more than 16.0 MiB, the most --prompt-file reads"),
    ],
)
def test_a_prompt_file_that_cannot_be_read_is_one_error_line(capsys, no_port_may_load, tmp_path, content, words):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(content)
    argv = ["generate", "--framework", "numpy", "--mode", "cached", "--prompt-file", prompts]
    assert words in assert_one_error_line(*run_cli(capsys, *argv))


# ---------------------------------------------------------------- bench: a disturbed bandwidth probe


def bench_with_probes(capsys, monkeypatch, seconds: list[float], *extra: str) -> tuple[dict, list[int]]:
    """`kvports bench` of NumPy with its bandwidth probe timed at `seconds`, one figure per probe."""
    from kvports.registry import load_port

    numpy_port = load_port("numpy")
    calls: list[int] = []

    def probe(rows, cols, repeats, device="cpu"):
        calls.append(repeats)
        return [seconds[len(calls) - 1]] * repeats

    monkeypatch.setattr(numpy_port, "matvec_seconds", probe)
    argv = ["bench", "--frameworks", "numpy", "--modes", "cached", "--new-tokens", "4", "--repeats", "1"]
    code, out, err = run_cli(capsys, *argv, "--roofline", *extra)
    assert code == 0, err
    return (json.loads(out) if "--json" in extra else {"table": out}), calls


def test_a_roofline_below_1_measures_the_bandwidth_again_and_keeps_the_better_probe(capsys, monkeypatch):
    result, calls = bench_with_probes(capsys, monkeypatch, [1e3, 1e-6], "--json")  # first probe: 256 KB/s
    assert len(calls) == 2 and result["machine"]["bandwidth_probes"] == 2
    assert result["machine"]["matvec"]["seconds"]["numpy"] == [1e-6] * calls[1]
    row = result["rows"][0]
    assert row["roofline_ratio"] > 1 and not row["roofline_disturbed"]


def test_a_roofline_still_below_1_is_flagged_in_the_table(capsys, monkeypatch):
    result, calls = bench_with_probes(capsys, monkeypatch, [1e3, 1e3])
    assert len(calls) == 2
    table = " ".join(result["table"].split())
    assert "x !" in table and "! roofline below 1: decode ran faster than the bandwidth probe allows" in table


def test_load_average_of_the_batching_bench_is_rounded(monkeypatch):
    import os

    from kvports.bench.throughput import machine

    monkeypatch.setattr(os, "getloadavg", lambda: (4.57373046875, 1.0, 1.0))
    assert machine(None)["load_average"] == [None, 4.57]


# ---------------------------------------------------------------- the Python API


def test_the_api_names_its_own_threads_argument(no_port_may_load):
    import kvports

    with pytest.raises(kvports.UserError, match=r"^threads=0 is below 1$"):
        kvports.load("numpy", threads=0)


def test_the_api_returns_logprobs(port):
    import kvports

    result = kvports.load(port.NAME).generate(SEED, new_tokens=3, logprobs=2)
    assert [step["token"] for step in result.logprobs[0]] == result.generated[0]
    with pytest.raises(kvports.UserError, match=r"^logprobs=21 is above 20$"):
        kvports.load(port.NAME).generate(SEED, new_tokens=3, logprobs=21)


def test_the_batching_benchs_bar_counts_a_run_once_it_has_finished(capsys, monkeypatch):
    from kvports.bench import throughput as batching
    from kvports.formats.weights import DEFAULT_WEIGHTS

    seen: list[tuple[str, int]] = []

    class Bar:  # records what the bar shows as each run starts, and at the end
        total = 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def add_task(self, description, total):
            self.total = total
            return 0

        def update(self, task, completed, description=""):
            seen.append((description, completed))

    monkeypatch.setattr(batching, "make_progress", lambda quiet: Bar())
    argv = ["batch", "--bench", "--frameworks", "numpy", "--weights", DEFAULT_WEIGHTS, "--count", "1", "--json"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    assert [completed for _, completed in seen] == [0, 1, 2, 3, 4]  # two runs per workload, both workloads
    assert seen[1][0] == "numpy mixed: sequential"  # the second half of the mixed workload has its own step
