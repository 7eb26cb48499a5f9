"""The arithmetic problems rl_math trains on: a seeded generator whose answers are right, and a
verifier that accepts only the final `#### N`."""

from __future__ import annotations

import re

from treadle.recipes.arithmetic import final_answer, problems, reward


def test_the_same_seed_gives_the_same_problems() -> None:
    assert problems(50, seed=3) == problems(50, seed=3)


def test_the_held_out_seed_gives_other_problems() -> None:
    train = {p.question for p in problems(1000, seed=0)}
    held_out = [p.question for p in problems(100, seed=10_000)]
    assert held_out != [p.question for p in problems(100, seed=0)]
    assert sum(q in train for q in held_out) < 50  # the question space is finite: some overlap


def test_every_answer_is_the_sum_or_difference_its_question_states() -> None:
    for p in problems(300, seed=1, max_operand=20):
        a, b = (int(n) for n in re.findall(r"\d+", p.question))
        subtract = any(w in p.question for w in ("gives away", "takes", "lost"))
        assert p.answer == (a - b if subtract else a + b), p
        assert 1 <= a <= 20 and 1 <= b <= 20 and p.answer >= 0


def test_both_operations_occur() -> None:
    answers = problems(200, seed=2)
    assert any("left" in p.question or "still" in p.question for p in answers)
    assert any("more" in p.question or "in all" in p.question for p in answers)


def test_the_prompt_is_a_system_instruction_and_the_question() -> None:
    p = problems(1, seed=0)[0]
    assert [m["role"] for m in p.messages] == ["system", "user"]
    assert "####" in p.messages[0]["content"] and p.messages[1]["content"] == p.question


def test_the_verifier_reads_the_last_final_answer() -> None:
    assert final_answer("3 + 4 = 7\n#### 7") == 7
    assert final_answer("#### 5\nno wait\n#### 12") == 12
    assert final_answer("####12 apples") == 12
    assert final_answer("#### -3") == -3


def test_an_answer_without_the_marker_scores_zero() -> None:
    assert final_answer("The answer is 7.") is None
    assert reward("The answer is 7.", 7) == 0.0
    assert reward("#### seven", 7) == 0.0
    assert reward("####", 7) == 0.0


def test_a_wrong_final_answer_scores_zero_even_if_the_right_one_appears_earlier() -> None:
    assert reward("#### 7\n#### 8", 7) == 0.0
    assert reward("7 is close; #### 70", 7) == 0.0


def test_the_right_final_answer_scores_one() -> None:
    assert reward("3 + 4 = 7\n#### 7", 7) == 1.0
    assert reward("#### 0", 0) == 1.0
