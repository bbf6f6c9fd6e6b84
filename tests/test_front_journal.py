"""The front's journal at a seam: where a continuation starts when the dead engine held back the text of its last
tokens (a character's first bytes), and what the client gets from the next engine.  The engine's side is the
chunks vLLM streams (one token each, empty text while a character is incomplete); the end-to-end test is
tests/engines/test_vllm_fast_paths.py."""
from restartkit.front.journal import Flight

PROMPT = [5, 6, 7]


def flight(**body) -> Flight:
    f = Flight(chat=False, body={"prompt": "x", "max_tokens": 10, "temperature": 0, **body},
               stream=True)
    f.prompt_ids = list(PROMPT)
    return f


def test_a_continuation_starts_at_the_end_of_the_clients_text_and_the_held_tokens_are_not_resent():
    f = flight(return_token_ids=True)
    assert f.take([11], "a")[0] == [11]
    assert f.take([12], "")[0] == [12]  # the first bytes of a character: held back
    assert f.take([13], "")[0] == [13]
    assert (f.clean, f.ids, f.text) == (1, [11, 12, 13], "a")
    route, body = f.continuation(max_model_len=64)
    assert route == "/v1/completions"
    assert body["prompt"] == PROMPT + [11] and body["max_tokens"] == 9
    assert f.redo == [12, 13]
    # the next engine generates them again, and the character's text comes with the last
    assert f.take([12], "")[0] == []
    assert f.take([13, 14], "\u00e9b")[0] == [14]
    assert (f.ids, f.text, f.clean, f.redo) == ([11, 12, 13, 14], "a\u00e9b", 4, [])
    assert f.usage()["completion_tokens"] == 4


def test_an_engine_that_dies_again_while_regenerating_continues_from_the_same_point():
    f = flight()
    f.take([11], "a")
    f.take([12], "")
    f.continuation(64)
    f.take([12], "")  # regenerated, still held; then the second engine dies too
    _, body = f.continuation(64)
    assert body["prompt"] == PROMPT + [11] and f.redo == [12] and body["max_tokens"] == 9


def test_a_sampled_draw_the_client_never_saw_replaces_the_held_tokens():
    f = flight(temperature=0.8)  # its ids not asked for: the held tokens were never shown
    f.take([11], "a")
    f.take([12], "")
    f.take([13], "")
    f.continuation(64)
    assert f.redo == [12, 13]
    assert f.take([12], "")[0] == []
    assert f.take([20], "z")[0] == [20]  # a different draw: 13 is dropped, 20 takes its place
    assert (f.ids, f.text, f.clean) == ([11, 12, 20], "az", 3)


def test_sampled_ids_the_client_has_seen_stand_and_the_continuation_starts_after_them():
    f = flight(temperature=0.8, return_token_ids=True)
    f.take([11], "a")
    f.take([12], "")
    _, body = f.continuation(64)
    assert body["prompt"] == PROMPT + [11, 12] and f.redo == [] and body["max_tokens"] == 8


def test_nothing_held_back_continues_after_every_id():
    f = flight(return_token_ids=True)
    f.take([11, 12], "ab")
    _, body = f.continuation(64)
    assert body["prompt"] == PROMPT + [11, 12] and f.redo == []


def test_text_that_may_start_a_stop_string_is_held_in_the_front_and_survives_the_engine():
    """vLLM holds back its text's last characters while a stop string could start there, and sends the ids: the
    front asks it to put the stop string in its text (so vLLM holds nothing) and holds that text itself, so a seam
    loses none of it."""
    f = flight(stop=["END", "\n\n"], return_token_ids=True)
    up = f.upstream_body()
    assert up["stop"] == ["END", "\n\n"] and up["include_stop_str_in_output"] is True
    assert f.take([11], "abE") == ([11], "ab")  # "E" may start "END"
    assert f.take([12], "N") == ([12], "")
    assert (f.text, f.held) == ("ab", "EN")
    route, body = f.continuation(64)  # the engine dies: the held text is the front's
    assert body["prompt"] == PROMPT + [11, 12] and body["stop"] == ["END", "\n\n"]
    assert body["include_stop_str_in_output"] is True
    assert f.take([13], "x\n") == ([13], "ENx")  # not "END": shown; "\n" may start "\n\n"
    assert f.take([14], "y") == ([14], "\ny")
    assert f.stop_reason is None and f.text == "abENx\ny"
    assert f.take([15], "zz", finish="length") == ([15], "zz")


def test_a_stop_string_across_a_seam_ends_the_answer_where_it_starts():
    f = flight(stop=["END"])
    assert f.take([11], "aEN") == ([11], "a")
    f.continuation(64)
    assert f.take([12], "Dtail") == ([12], "")
    assert (f.stop_reason, f.text) == ("END", "a")
    assert f.answer()["choices"][0]["stop_reason"] == "END"
    g = flight(stop="END", include_stop_str_in_output=True)
    assert g.take([11], "xENDy") == ([11], "xEND") and g.stop_reason == "END"


def test_stop_strings_wait_for_min_tokens_and_a_held_end_is_shown_when_the_answer_ends():
    f = flight(stop=["ab"], min_tokens=2)
    assert f.take([11], "ab") == ([11], "ab")  # one token: too early for a stop string
    assert f.take([12], "xa") == ([12], "x")
    assert f.flush() == "a" and f.text == "abxa"
    from restartkit.front.journal import journalled
    assert not journalled({"prompt": "x", "stop": [1, 2]}) and journalled({"prompt": "x", "stop": ["a"]})
