"""Instruction records (fedsplice.data.instruct) and free-text scores (fedsplice.federation.textmetrics)."""

from __future__ import annotations

import json
import pickle

import pytest

from fedsplice.data import instruct as I
from fedsplice.errors import ConfigError
from fedsplice.federation import textmetrics as T


def test_the_three_forms_give_the_same_turns():
    a = I.record({"prompt": "Define tree.", "response": "A woody plant."}, "f line 1")
    b = I.record({"instruction": "Define tree.", "input": "", "output": "A woody plant."}, "f line 2")
    c = I.record({"messages": [{"role": "user", "content": "Define tree."},
                               {"role": "assistant", "content": "A woody plant."}]}, "f line 3")
    assert a.messages == b.messages == c.messages == (("user", "Define tree."),)
    assert a.response == b.response == c.response == "A woody plant."
    assert a == b == c  # the key names the content, not where it came from
    assert not a.choice and a.answer is None


def test_alpaca_input_joins_the_instruction_and_system_leads():
    r = I.record({"instruction": "Translate.", "input": "hola", "output": "hello", "system": "Be brief."}, "w")
    assert r.messages == (("system", "Be brief."), ("user", "Translate.\n\nhola"))
    assert r.prompt == "Translate.\n\nhola"


def test_multi_turn_messages_keep_the_context_and_answer_the_last():
    r = I.record({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"},
                               {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"},
                               {"role": "assistant", "content": "a2"}]}, "w")
    assert r.messages == (("system", "S"), ("user", "q1"), ("assistant", "a1"), ("user", "q2"))
    assert r.response == "a2"


def test_inner_whitespace_of_code_answers_stays():
    r = I.record({"prompt": "Write it.", "response": "  def f():\n    return 1\n"}, "w")
    assert r.response == "def f():\n    return 1"


def test_multiple_choice_by_letter_or_text_and_its_default_response():
    r = I.record({"prompt": "Which?", "options": ["red", "blue", "green"], "answer": "B"}, "w")
    assert (r.options, r.answer, r.response) == (("red", "blue", "green"), 1, "B. blue")
    assert I.record({"prompt": "Which?", "options": ["red", "blue"], "answer": "red"}, "w").answer == 0
    csv_cell = I.record({"prompt": "Which?", "options": '["x", "y"]', "answer": "y", "response": "y it is"}, "w")
    assert (csv_cell.options, csv_cell.answer, csv_cell.response) == (("x", "y"), 1, "y it is")


@pytest.mark.parametrize("row, match", [
    ({"prompt": "q"}, "f line 4: missing field `response`"),
    ({"prompt": "q", "response": "   "}, "f line 4: `response` is empty"),
    ({"instruction": "q"}, "f line 4: missing field `output`"),
    ({"prompt": "q", "instruction": "q", "response": "r"}, "more than one of the forms"),
    ({"text": "q", "label": "x"}, r"none of the forms .* \(fields found: label, text\)"),
    ({"messages": [{"role": "user", "content": "q"}]}, "at least a user turn and the assistant's answer"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "user", "content": "r"}]}, "last of `messages`"),
    ({"messages": [{"role": "bot", "content": "q"}, {"role": "assistant", "content": "r"}]}, r"messages\[0\]"),
    ({"prompt": "q", "options": ["a", "b"], "answer": "C"}, "neither a letter A-B"),
    ({"prompt": "q", "options": ["a"], "answer": "A"}, "2 to 26 non-empty texts"),
    ({"prompt": "q", "response": "r", "answer": "A"}, "`answer` without `options`"),
    ({"prompt": "q", "options": ["a", "b"]}, "`options` without `answer`"),
    ({"prompt": ["q"], "response": "r"}, "`prompt` is a list"),
])
def test_a_bad_record_is_one_line_naming_where_and_the_field(row, match):
    with pytest.raises(ConfigError, match=match) as e:
        I.record(row, "f line 4")
    assert "\n" not in str(e.value)


def test_other_fields_are_kept_for_partitions_and_records_pickle():
    r = I.record({"prompt": "q", "response": "r", "client": 7, "topic": "bio", "split": "test", "n": 3}, "w")
    assert r.fields == {"client": "7", "topic": "bio", "split": "test", "n": "3"}
    back = pickle.loads(pickle.dumps(r))
    assert back == r and back.messages == r.messages and back.fields == r.fields


def test_read_jsonl_and_csv_name_the_bad_line(tmp_path):
    good = [{"prompt": "q1", "response": "r1"}, {"instruction": "q2", "output": "r2"}]
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(map(json.dumps, good)) + "\n\n")
    assert [r.response for r in I.read(p)] == ["r1", "r2"]
    p.write_text(json.dumps(good[0]) + "\n" + json.dumps({"prompt": "q"}) + "\n")
    with pytest.raises(ConfigError, match=r"d.jsonl line 2: missing field `response`"):
        I.read(p)
    c = tmp_path / "d.csv"
    c.write_text('prompt,response,options,answer\nq1,r1,,\n"Which?",,"[""a"", ""b""]",B\n')
    recs = I.read(c)
    assert recs[0].response == "r1" and (recs[1].options, recs[1].response) == (("a", "b"), "B. b")
    c.write_text("prompt,response\nq1,\n")
    with pytest.raises(ConfigError, match=r"d.csv line 2: missing field `response`"):
        I.read(c)
    c.write_bytes(b"prompt,response\nq1,caf\xe9\n")
    with pytest.raises(ConfigError, match=r"d.csv line 2: not UTF-8"):
        I.read(c)
    with pytest.raises(ConfigError, match="not a file"):
        I.read(tmp_path / "absent.jsonl")
    # a key given twice: json and csv would keep the last silently
    p.write_text(json.dumps(good[0]) + '\n{"prompt": "q", "response": "a", "response": "b"}\n')
    with pytest.raises(ConfigError, match=r"d.jsonl line 2 names `response` 2 times \(fields 2, 3\)"):
        I.read(p)
    c.write_text("prompt,response,prompt\nq1,r1,q2\n")
    with pytest.raises(ConfigError, match=r"d.csv: the header row names `prompt` 2 times \(fields 1, 3\)"):
        I.read(c)


# ----------------------------------------------------------------------------- text scores
def test_exact_match_and_token_f1_by_hand():
    assert T.normalize("The  Cat, sat!") == "cat sat"
    assert T.exact_match("the cat sat.", "Cat sat") == 1.0
    assert T.exact_match("a cat", "dog") == 0.0
    # prediction "cat sat on mat" (4 words), reference "cat on the red mat" -> "cat on red mat" (4):
    # common {cat, on, mat} = 3; P = R = 3/4; F1 = 0.75
    assert T.token_f1("cat sat on mat", "cat on the red mat") == pytest.approx(0.75)
    # repeated words count as often as they repeat on both sides: P = 2/3, R = 2/2 -> 0.8
    assert T.token_f1("go go go", "go go") == pytest.approx(0.8)
    assert T.token_f1("", "") == 1.0 and T.token_f1("x", "") == 0.0 and T.token_f1("the", "a") == 1.0


def test_rouge_l_is_the_lcs_f_measure():
    # LCS("the cat sat on the mat", "the cat on mat") = 4 words: P = 4/4, R = 4/6 -> F = 0.8
    assert T.rouge_l("the cat on mat", "the cat sat on the mat") == pytest.approx(0.8)
    assert T.rouge_l("x y", "a b") == 0.0
    s = T.scores("The cat.", "the cat")
    assert s == {"exact_match": 1.0, "token_f1": 1.0, "rouge_l": 1.0}


@pytest.mark.parametrize("text, n, want", [
    ("B", 4, 1), ("b. blue", 4, 1), (" (C) because", 4, 2), ("D\n## note", 4, 3), ("a cat", 4, 0),
    ("Answer: B", 4, 0), ("E", 4, None), ("", 4, None), ("because", 4, 1), ("because", 1, None),
])
def test_choice_letter_parses_as_flowertune_does(text, n, want):
    # the first character after lowercasing and blanking non-alphanumerics, so "Answer: B" picks A
    # and "because" B: the parsed score measures format compliance too
    assert T.choice_letter(text, n) == want
