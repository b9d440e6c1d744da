"""The Python API's own arguments refused: a wrong type, an n-gram past the run, threads below 1.
Each is one `UserError` naming the API's argument (`ngram=8`, not `--ngram 8`), before any port
loads where the arguments alone tell. (The API refusing what the command line refuses, with its
message: tests/test_api.py.)"""

from __future__ import annotations

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
