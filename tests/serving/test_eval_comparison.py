"""tools/eval_ports.py (make eval): lm-eval's per-item results read back and compared across servers,
on canned results; neither lm-eval nor a server runs here. What the run against the real servers
gave is docs/SERVING.md's table."""

from __future__ import annotations

import json

import pytest

from tools import eval_ports
from tools.eval_ports import PEER, Item, chosen, compare, encode_pair, read_requests, read_samples


def item(target, *loglikelihoods, lengths=None):
    return Item(target, tuple(loglikelihoods), tuple(lengths or [4] * len(loglikelihoods)))


def test_the_choice_is_the_largest_loglikelihood_and_the_first_of_a_tie():
    assert chosen(item(0, -3.0, -1.0, -2.0)) == 1
    assert chosen(item(0, -1.0, -2.0, -1.0)) == 0


def test_the_normalised_choice_divides_each_loglikelihood_by_its_choices_characters():
    answer = item(0, -6.0, -4.0, lengths=[12, 4])  # -0.5 a character against -1.0
    assert chosen(answer) == 1 and chosen(answer, normalised=True) == 0


RUNS = {
    "kvports numpy": {0: item(0, -1.0, -2.0), 1: item(1, -2.00004, -1.0), 2: item(0, -1.0, -1.00002)},
    "kvports torch": {0: item(0, -1.00001, -2.0), 1: item(1, -2.0, -1.0), 2: item(0, -1.00002, -1.0)},
    "kvports jax": {0: item(0, -1.0, -2.0), 1: item(1, -2.00004, -1.0), 2: item(0, -1.0, -1.00002)},
}


def test_the_ports_agree_on_the_items_where_every_port_chose_alike():
    report = compare(RUNS, "kvports torch")
    assert report["items"] == 3
    assert report["ports_agree_on"] == 2 and report["ports_disagree_on"] == [2]  # a near-tie that flipped


def test_each_server_counts_the_items_it_chose_as_the_reference_did_and_its_accuracy():
    servers = compare(RUNS, "kvports torch")["servers"]
    assert servers["kvports numpy"]["same_choice_as_reference"] == 2
    assert servers["kvports torch"]["same_choice_as_reference"] == 3
    assert servers["kvports numpy"]["accuracy"] == 1.0
    assert servers["kvports torch"]["accuracy"] == pytest.approx(2 / 3)


def test_the_largest_loglikelihood_distance_is_over_every_choice_of_every_item_either_way():
    report = compare(RUNS, "kvports torch")
    assert report["servers"]["kvports numpy"]["max_abs_delta_vs_reference"] == pytest.approx(4e-5)  # numpy's lower
    assert report["servers"]["kvports torch"]["max_abs_delta_vs_reference"] == 0.0
    assert report["max_abs_delta_between_ports"] == pytest.approx(4e-5)
    assert report["pairs"]["kvports numpy / kvports jax"] == 0.0


def test_the_closest_call_is_the_references_smallest_margin_between_its_two_likeliest_choices():
    closest = compare(RUNS, "kvports torch")["closest_call"]
    assert closest["doc_id"] == 2 and closest["margin"] == pytest.approx(2e-5)


def test_the_peer_is_compared_with_the_reference_but_not_counted_among_the_ports():
    runs = {**RUNS, PEER: {0: item(0, -2.0, -1.0), 1: item(1, -2.0, -1.0), 2: item(0, -1.0, -2.0)}}
    report = compare(runs, "kvports torch")
    assert PEER not in report["ports"] and report["ports_agree_on"] == 2
    assert report["servers"][PEER]["same_choice_as_reference"] == 1


def test_servers_that_scored_different_items_are_refused():
    runs = {"kvports torch": RUNS["kvports torch"], "kvports numpy": {0: RUNS["kvports numpy"][0]}}
    with pytest.raises(SystemExit, match="scored items"):
        compare(runs, "kvports torch")


def sample(doc_id, target, loglikelihoods, acc):
    """One line of lm-eval's --log_samples file for a multiple_choice task, as 0.4.13 writes it (its
    responses as strings)."""
    choices = ["a", "bb", "ccc"]
    return {
        "doc_id": doc_id,
        "doc": {"question": "q", "choices": choices, "answer": target},
        "target": str(target),
        "arguments": {f"gen_args_{index}": {"arg_0": "Q?\nA:", "arg_1": f" {c}"} for index, c in enumerate(choices)},
        "filtered_resps": [[str(value), "False"] for value in loglikelihoods],
        "acc": acc,
    }


def write_samples(folder, lines):
    (folder / "model").mkdir()
    path = folder / "model" / "samples_kvports_mc_2026-01-01T00-00-00.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_lm_evals_samples_file_is_read_as_items_by_doc_id(tmp_path):
    write_samples(tmp_path, [sample(0, 2, [-3.0, -2.5, -1.25], 1.0), sample(1, 0, [-1.0, -2.0, -3.0], 1.0)])
    items = read_samples(tmp_path)
    assert items[0] == Item(2, (-3.0, -2.5, -1.25), (1, 2, 3))
    assert chosen(items[1]) == 0


def test_lm_evals_requests_are_read_as_each_items_context_and_continuations(tmp_path):
    write_samples(tmp_path, [sample(0, 2, [-3.0, -2.5, -1.25], 1.0)])
    assert read_requests(tmp_path) == {0: [("Q?\nA:", " a"), ("Q?\nA:", " bb"), ("Q?\nA:", " ccc")]}


def characters(text):
    return [ord(character) for character in text]


def test_a_request_is_split_into_tokens_as_lm_eval_splits_it():
    words = {"Answer:": [1], "Answer: Paris": [1, 2], "Answer:  Paris": [1, 3]}  # a tokenizer of whole strings
    assert encode_pair(words.__getitem__, "Answer:", " Paris") == ([1], [2])
    assert encode_pair(words.__getitem__, "Answer: ", " Paris") == ([1], [3])  # the context's space moves over
    assert encode_pair(characters, "ab", "cd") == (characters("ab"), characters("cd"))


def test_a_samples_file_whose_acc_is_not_the_largest_loglikelihoods_is_refused(tmp_path):
    write_samples(tmp_path, [sample(0, 2, [-3.0, -2.5, -1.25], 0.0)])
    with pytest.raises(SystemExit, match="lm-eval's acc"):
        read_samples(tmp_path)


def test_serving_mds_table_is_the_committed_run():
    document = json.loads(eval_ports.RESULTS.read_text())
    table = eval_ports.markdown(document["report"], document["timings"])
    assert table in (eval_ports.ROOT / "docs" / "SERVING.md").read_text(), "paste python tools/eval_ports.py --table"
