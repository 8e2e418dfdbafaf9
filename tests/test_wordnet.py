"""WordNet's definitions as instruction records (fedsplice.data.wordnet)."""

from __future__ import annotations

import pytest

from fedsplice.data import wordnet as W

HEADER = "  1 This software and database is being provided to you, the LICENSEE, by\n"
ADJ = ("01000442 00 s 02 happy 0 well-chosen 0 001 & 00999817 a 0000 | well expressed and to the point; "
       '"a happy turn of phrase"; "a few well-chosen words"  \n')
VERB = ("00001740 29 v 04 breathe 0 take_a_breath 0 respire 0 suspire 3 002 * 00005041 v 0000 "
        "$ 00002325 v 0000 02 + 02 00 + 08 00 | draw air into, and expel out of, the lungs; \"I can breathe better\"\n")
MARKED = "00013887 00 a 01 ablaze(p) 0 000 | lighted up by or as if by fire or flame  \n"


def test_a_line_gives_its_words_and_the_definition_before_the_examples():
    assert W.parse_line(HEADER) is None
    assert W.parse_line(ADJ) == (["happy", "well-chosen"], "well expressed and to the point")
    # w_cnt is hexadecimal; underscores are spaces; verb frames after the pointers are ignored
    assert W.parse_line(VERB) == (["breathe", "take a breath", "respire", "suspire"],
                                  "draw air into, and expel out of, the lungs")
    assert W.parse_line(MARKED) == (["ablaze"], "lighted up by or as if by fire or flame")  # "(p)" dropped


def test_only_words_with_one_sense_are_asked():
    other = "01148283 00 a 01 happy 0 000 | enjoying or showing or marked by joy or pleasure  \n"
    rows = W.rows_of("adjective", [HEADER, ADJ, other, MARKED])
    # "happy" names two synsets: asked for neither; "ablaze" has one
    assert rows == [{"prompt": 'Define the adjective "ablaze".', "response": "lighted up by or as if by fire or flame",
                     "pos": "adjective"}]


@pytest.mark.real_weights
def test_the_package_builds_the_pinned_records():
    recs, source = W.load()  # the user's asset cache: wordnet-base fetched once, its sha256 pins checked
    assert "WordNet 3.0" in source
    by_pos = {}
    for r in recs:
        by_pos[r.fields["pos"]] = by_pos.get(r.fields["pos"], 0) + 1
    assert by_pos == {"noun": 53698, "verb": 3180, "adjective": 9876, "adverb": 2428}
    assert len({r.prompt for r in recs}) == len(recs)  # one right answer a prompt
