"""The Python API's own arguments refused: a wrong type, an n-gram past the run, threads below 1.
Each is one `UserError` naming the API's argument (`ngram=8`, not `--ngram 8`), before any port
loads where the arguments alone tell. (The API refusing what the command line refuses, with its
message: tests/test_api.py.)"""

from __future__ import annotations

import numpy as np
import pytest

import kvports
from tests.helpers.commands import api_message


def test_the_api_bounds_ngram_naming_its_own_argument(port):
    model = kvports.load(port.NAME)
    message = api_message(lambda: model.generate([1, 2, 3], 4, "speculative", draft="ngram", ngram=8))
    assert message == "ngram=8 is above prompt length 3 + new tokens 4 = 7, the tokens the run holds"


LOAD_TYPES = {
    "weights_a_number": (("numpy", 123), {}, "weights=123 is not a path"),
    "framework_a_number": ((5,), {}, "framework=5 is not one of torch, jax, numpy"),
    "model_a_number": (("numpy",), dict(model=5), "model=5 is not a model's name"),
}


@pytest.mark.parametrize("case", sorted(LOAD_TYPES))
def test_load_refuses_an_argument_of_the_wrong_type_by_name(no_port_may_load, case):
    args, keywords, expected = LOAD_TYPES[case]
    assert api_message(lambda: kvports.load(*args, **keywords)) == expected


GENERATE_TYPES = {
    "stop_ids_a_number": (dict(stop_ids=5), "stop_ids=5 is not a list of token ids"),
    "stop_ids_a_string": (dict(stop_ids="12"), "stop_ids='12' is not a list of token ids"),
    "draft_a_number": (dict(mode="speculative", draft=5), "draft=5 is not a path or 'ngram'"),
    "on_token_a_number": (dict(on_token=5), "on_token=5 is not callable"),
    "return_logits_a_string": (dict(return_logits="yes"), "return_logits='yes' is not True or False"),
    "mode_a_number": (dict(mode=3), "mode=3 is not one of naive, cached, speculative"),
    "prompts_a_number": (dict(prompts=5), "prompts=5 is not a prompt: ids, a batch of them, or '1,2,3'"),
    "draft_empty": (
        dict(mode="speculative", draft=""),
        "draft='' is empty: give a smaller model's weights file or 'ngram'",
    ),
}


@pytest.mark.parametrize("case", sorted(GENERATE_TYPES))
def test_generate_refuses_an_argument_of_the_wrong_type_by_name(port, case):
    keywords, expected = GENERATE_TYPES[case]
    model = kvports.load(port.NAME)
    assert api_message(lambda: model.generate(**{"new_tokens": 2, **keywords})) == expected


def test_the_api_names_its_own_threads_argument(no_port_may_load):
    import kvports

    with pytest.raises(kvports.UserError, match=r"^threads=0 is below 1$"):
        kvports.load("numpy", threads=0)


# --- bytes, and lists bounded before they are read ------------------------------------------------

BOUNDED = {
    "prompts_bytes": (dict(prompts=b"1,2,3"), "prompts=b'1,2,3' is bytes: give token ids, or '1,2,3' as a str"),
    "a_row_of_bytes": (dict(prompts=[b"1,2", b"3"]), "prompts=b'1,2' is bytes: give token ids, or '1,2,3' as a str"),
    "prompts_a_range_of_10**9": (dict(prompts=range(10**9)), "prompts holds 1000000000 ids, above 1048576"),
    "a_row_a_range_of_10**9": (dict(prompts=[range(10**9)]), "prompts holds 1000000000 ids, above 1048576"),
    "stop_ids_a_range_of_10**9": (dict(stop_ids=range(10**9)), "stop_ids holds 1000000000 ids, above 1048576"),
}


@pytest.mark.parametrize("case", sorted(BOUNDED))
def test_generate_refuses_bytes_and_lists_past_their_bound_unread(case):
    keywords, expected = BOUNDED[case]
    model = kvports.load("numpy")
    assert api_message(lambda: model.generate(**{"new_tokens": 2, **keywords})) == expected


NUMPY_SCALARS = {
    "temperature": (dict(temperature=np.float32(0.5), seed=3), dict(temperature=0.5, seed=3)),
    "top_p": (dict(temperature=0.5, top_p=np.float32(0.9)), dict(temperature=0.5, top_p=float(np.float32(0.9)))),
    "draft_tokens and ngram": (
        dict(mode="speculative", draft="ngram", draft_tokens=np.uint64(2), ngram=np.uint64(1)),
        dict(mode="speculative", draft="ngram", draft_tokens=2, ngram=1),
    ),
}


@pytest.mark.parametrize("case", sorted(NUMPY_SCALARS))
def test_numpy_scalars_are_taken_as_their_python_values(case):
    given, python = NUMPY_SCALARS[case]
    model = kvports.load("numpy")
    expected = model.generate([1, 2, 3], **{"new_tokens": 3, **python}).tokens
    assert model.generate([1, 2, 3], **{"new_tokens": 3, **given}).tokens == expected


def test_a_numpy_integer_thread_count_is_taken_as_its_value():
    model = kvports.load("numpy", threads=np.uint64(1))
    assert (
        model.generate([1, 2, 3], new_tokens=2).tokens == kvports.load("numpy").generate([1, 2, 3], new_tokens=2).tokens
    )
