"""Quiz widget: bank validation, headless feedback and score."""
import json

import ipywidgets as w
import pytest

from labutils.widgets import Quiz, quiz
from labutils.widgets.quiz import QUIZ_DIR, load_questions, validate_questions

QUESTIONS = [
    {"question": "2 + 2?", "options": ["3", "4"], "answer": 1, "explanation": "Two pairs make four."},
    {"question": "Decode is limited by?", "options": ["FLOP/s", "bandwidth", "disk"], "answer": 1,
     "explanation": "Each step reads every weight."},
]


def test_initial_state_has_no_selection_and_zero_score():
    q = Quiz(QUESTIONS)
    assert isinstance(q, w.VBox)
    assert len(q.radios) == 2 and all(r.value is None for r in q.radios)
    assert all(f.value == "" for f in q.feedback)
    assert "Score: 0 / 2" in q.score.value and "0 answered" in q.score.value


def test_right_answer_gives_correct_feedback_and_scores():
    q = Quiz(QUESTIONS)
    q.radios[0].value = 1
    assert "Correct." in q.feedback[0].value and "Two pairs make four." in q.feedback[0].value
    assert q.n_correct == 1
    assert "Score: 1 / 2" in q.score.value


def test_wrong_answer_gives_not_quite_and_first_try_counts():
    q = Quiz(QUESTIONS)
    q.radios[1].value = 0
    assert "Not quite." in q.feedback[1].value and "Each step reads every weight." in q.feedback[1].value
    assert "Score: 0 / 2" in q.score.value and "1 answered" in q.score.value
    q.radios[1].value = 1  # the feedback follows the new choice, the first-try score does not
    assert "Correct." in q.feedback[1].value
    assert q.n_correct == 0 and "Score: 0 / 2" in q.score.value


def test_text_is_html_escaped():
    q = Quiz([{"question": "Is <b> safe?", "options": ["a<b", "b"], "answer": 0, "explanation": "x < y"}])
    q.radios[0].value = 0
    assert "x &lt; y" in q.feedback[0].value
    assert "Is &lt;b&gt; safe?" in q.children[0].value


@pytest.mark.parametrize("bad, match", [
    ([], "non-empty list"),
    ({"question": "x"}, "non-empty list"),
    ([{"question": "x", "options": ["a", "b"], "answer": 2, "explanation": ""}], "index 0..1"),
    ([{"question": "x", "options": ["a", "b"], "answer": -1, "explanation": ""}], "index 0..1"),
    ([{"question": "x", "options": ["a", "b"], "answer": True, "explanation": ""}], "index"),
    ([{"question": "x", "options": ["a"], "answer": 0, "explanation": ""}], "at least 2"),
    ([{"question": "x", "options": ["a", "a"], "answer": 0, "explanation": ""}], "distinct"),
    ([{"question": "x", "options": ["a", "b"], "answer": 0}], "missing field"),
    ([{"question": "", "options": ["a", "b"], "answer": 0, "explanation": ""}], "non-empty string"),
])
def test_validation_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        validate_questions(bad)


def test_missing_file_names_path_and_format(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        quiz("99", quiz_dir=tmp_path)
    assert str(tmp_path / "99.json") in str(err.value) and '"answer"' in str(err.value)


def test_bad_json_and_bad_bank_from_file(tmp_path):
    (tmp_path / "x.json").write_text("[{", encoding="utf-8")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_questions("x", tmp_path)
    (tmp_path / "y.json").write_text(json.dumps([dict(QUESTIONS[0], answer=5)]), encoding="utf-8")
    with pytest.raises(ValueError, match="y.json, question 1"):
        load_questions("y", tmp_path)


def test_quiz_loads_from_dir(tmp_path):
    (tmp_path / "07.json").write_text(json.dumps(QUESTIONS), encoding="utf-8")
    q = quiz("07", quiz_dir=tmp_path)
    assert len(q.radios) == 2


@pytest.mark.parametrize("path", sorted(QUIZ_DIR.glob("*.json")), ids=lambda p: p.name)
def test_every_committed_bank_is_valid(path):
    questions = load_questions(path.stem)
    assert len(questions) >= 2
    q = quiz(path.stem)
    for radio, question in zip(q.radios, questions):
        radio.value = question.answer
    assert q.n_correct == len(questions)


def test_an_out_of_range_choice_never_raises_from_the_observer_and_is_named_by_check():
    q = Quiz(QUESTIONS)
    q._on_choice(0, 99)                           # what a stray widget value would send
    assert "choice 99 is not one of question 1&#x27;s options 0..1" in q.feedback[0].value and q.n_answered == 0
    with pytest.raises(ValueError, match="question index 7 is not one of"):
        q.check(7, 0)
    with pytest.raises(ValueError, match="choice -1 is not one of"):
        q.check(0, -1)
