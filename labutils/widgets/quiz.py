"""Checkpoint quiz: multiple-choice questions with instant feedback and a running score."""
from __future__ import annotations

import html
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import ipywidgets as w

from labutils.core.paths import data_dir

QUIZ_DIR = data_dir("quizzes")

FORMAT_HINT = ('a JSON list of {"question": str, "options": [str, str, ...], '
               '"answer": index into options, "explanation": str}')


@dataclass(frozen=True)
class Question:
    """One multiple-choice question; `answer` indexes `options`."""

    question: str
    options: tuple[str, ...]
    answer: int
    explanation: str


def validate_questions(raw: Any, source: str = "questions") -> list[Question]:
    """Check a list of question dicts (or Questions) and return them as Questions.

    Errors name the question number and the field, so a typo in a quiz bank is quick to find.
    """
    if not isinstance(raw, (list, tuple)) or len(raw) == 0:
        raise ValueError(f"{source}: expected a non-empty list of questions, i.e. {FORMAT_HINT}")
    questions = []
    for i, item in enumerate(raw, start=1):
        if isinstance(item, Question):
            item = {"question": item.question, "options": list(item.options),
                    "answer": item.answer, "explanation": item.explanation}
        where = f"{source}, question {i}"
        if not isinstance(item, dict):
            raise ValueError(f"{where}: expected an object, got {type(item).__name__}; format is {FORMAT_HINT}")
        missing = [k for k in ("question", "options", "answer", "explanation") if k not in item]
        if missing:
            raise ValueError(f"{where}: missing field(s) {missing}; format is {FORMAT_HINT}")
        text, options, answer, explanation = (item["question"], item["options"],
                                              item["answer"], item["explanation"])
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{where}: 'question' must be a non-empty string")
        if not isinstance(options, (list, tuple)) or len(options) < 2:
            raise ValueError(f"{where}: 'options' must be a list of at least 2 strings, got {options!r}")
        if not all(isinstance(o, str) and o.strip() for o in options):
            raise ValueError(f"{where}: every option must be a non-empty string, got {options!r}")
        if len(set(options)) != len(options):
            raise ValueError(f"{where}: options must be distinct, got {options!r}")
        # bool is an int subclass; `"answer": true` is a typo, not index 1.
        if not isinstance(answer, int) or isinstance(answer, bool) or not 0 <= answer < len(options):
            raise ValueError(f"{where}: 'answer' must be an index 0..{len(options) - 1} into options, "
                             f"got {answer!r}")
        if not isinstance(explanation, str):
            raise ValueError(f"{where}: 'explanation' must be a string")
        questions.append(Question(text, tuple(options), answer, explanation))
    return questions


def load_questions(lesson_id: str, quiz_dir: str | Path | None = None) -> list[Question]:
    """Read and check data/quizzes/<lesson_id>.json."""
    path = Path(quiz_dir) if quiz_dir is not None else QUIZ_DIR
    path = path / f"{lesson_id}.json"
    if not path.is_file():
        raise FileNotFoundError(f"no quiz bank at {path}; create it as {FORMAT_HINT}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}); it should be {FORMAT_HINT}") from None
    return validate_questions(raw, source=str(path))


class Quiz(w.VBox):
    """A quiz widget: one RadioButtons per question, feedback on each choice, a running score.

    The score counts questions answered correctly on the first try, so guessing until the
    feedback turns green does not inflate it; feedback always reflects the current choice.
    """

    def __init__(self, questions: Iterable[Question | dict] | Sequence, title: str | None = None):
        self.questions = validate_questions(list(questions))
        self.first_choice: list[int | None] = [None] * len(self.questions)
        self.radios: list[w.RadioButtons] = []
        self.feedback: list[w.HTML] = []
        self.score = w.HTML()
        rows: list[w.Widget] = []
        if title:
            rows.append(w.HTML(f"<h3>{html.escape(title)}</h3>"))
        for i, q in enumerate(self.questions):
            radio = w.RadioButtons(options=[(opt, k) for k, opt in enumerate(q.options)], value=None,
                                   layout=w.Layout(width="max-content"))
            radio.observe(lambda change, i=i: self._on_choice(i, change["new"]), names="value")
            feedback = w.HTML("")
            self.radios.append(radio)
            self.feedback.append(feedback)
            rows += [w.HTML(f"<b>{i + 1}. {html.escape(q.question)}</b>"), radio, feedback]
        rows.append(self.score)
        super().__init__(rows)
        self._update_score()

    def check(self, index: int, choice: int) -> bool:
        """Is `choice` the right option for question `index`? (the plain function behind the widget)"""
        self._check_choice(index, choice)
        return choice == self.questions[index].answer

    def _check_choice(self, index, choice) -> None:
        n = len(self.questions)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n:
            raise ValueError(f"question index {index!r} is not one of 0..{n - 1}")
        options = self.questions[index].options
        if isinstance(choice, bool) or not isinstance(choice, int) or not 0 <= choice < len(options):
            raise ValueError(f"choice {choice!r} is not one of question {index + 1}'s options 0..{len(options) - 1}")

    def feedback_text(self, index: int, choice: int) -> str:
        q = self.questions[index]
        verdict = "Correct." if self.check(index, choice) else "Not quite."
        return f"{verdict} {q.explanation}".strip()

    @property
    def n_correct(self) -> int:
        return sum(c is not None and self.check(i, c) for i, c in enumerate(self.first_choice))

    @property
    def n_answered(self) -> int:
        return sum(c is not None for c in self.first_choice)

    def _on_choice(self, index: int, choice: int | None) -> None:
        # An observer never raises. A bad choice is said where its question's feedback goes; a bad index has no
        # feedback of its own, so it is said under the score.
        where = self.feedback[index] if isinstance(index, int) and 0 <= index < len(self.feedback) else self.score
        if choice is None:
            where.value = ""
            return
        try:
            self._check_choice(index, choice)
        except ValueError as err:
            where.value = f'<div style="color:#b35900">{html.escape(str(err))}</div>'
            return
        if self.first_choice[index] is None:
            self.first_choice[index] = choice
        ok = self.check(index, choice)
        color = "#1a7f37" if ok else "#b35900"
        mark = "&#10004;" if ok else "&#10008;"
        self.feedback[index].value = (f'<div style="color:{color}">{mark} '
                                      f'{html.escape(self.feedback_text(index, choice))}</div>')
        self._update_score()

    def _update_score(self) -> None:
        self.score.value = (f"<b>Score: {self.n_correct} / {len(self.questions)}</b> correct on the first try "
                            f"({self.n_answered} answered)")


def quiz(lesson_id: str, quiz_dir: str | Path | None = None) -> Quiz:
    """The checkpoint quiz for a lesson, from data/quizzes/<lesson_id>.json."""
    return Quiz(load_questions(lesson_id, quiz_dir), title=f"Checkpoint quiz: lesson {lesson_id}")
