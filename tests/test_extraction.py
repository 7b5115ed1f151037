from driver.extraction import extract_answer, parse_proposal

PROPOSAL = """Sure.
<answer>
```python
def f(xs, k):
    return sorted(xs)[:k]
```
```input
[3, 1, 2], 2
```
</answer>"""


def test_extract_answer_takes_last_block_and_unwraps_a_fence():
    assert extract_answer("<answer>1</answer> then <answer> [1, 2] </answer>") == "[1, 2]"
    assert extract_answer("<answer>\n```python\ndef f(x):\n    return x\n```\n</answer>") == "def f(x):\n    return x"


def test_extract_answer_none_when_malformed():
    assert extract_answer("no tags at all") is None
    assert extract_answer("<answer>unterminated") is None
    assert extract_answer("") is None


def test_parse_proposal_code_o():
    p = parse_proposal("code_o", PROPOSAL)
    assert p.error is None
    assert p.program.startswith("def f(xs, k):")
    assert p.input == "[3, 1, 2], 2"


def test_parse_proposal_rejects_missing_parts():
    assert parse_proposal("code_i", "def f(x): return x").error.startswith("malformed: no <answer>")
    assert "no ```input" in parse_proposal("code_i", "<answer>```python\ndef f(x):\n    return x\n```</answer>").error
    assert "defining f" in parse_proposal("code_o", "<answer>```input\n1\n```</answer>").error


def test_parse_proposal_code_f_needs_distinct_inputs_and_reads_message():
    text = "<answer>" + "".join(f"```input\n{i}\n```\n" for i in (1, 2, 2, 3, 4)) + "```message\nadds one\n```</answer>"
    p = parse_proposal("code_f", text, induction_inputs=4)
    assert p.error is None and p.inputs == ("1", "2", "3", "4") and p.message == "adds one"
    short = parse_proposal("code_f", "<answer>```input\n1\n```\n```input\n1\n```</answer>", induction_inputs=4)
    assert short.error == "malformed: 1 distinct inputs, 4 needed"


def test_open_answer_block_is_closed_by_the_end_only_when_allowed():
    text = "<answer>\n```python\ndef f(x):\n    return x\n```\n```input\n3\n```\nand then some chatter"
    assert parse_proposal("code_o", text).error.startswith("malformed: no <answer>")
    p = parse_proposal("code_o", text, require_close=False)
    assert p.error is None and p.input == "3"
    assert extract_answer("<answer> [1, 2]", require_close=False) == "[1, 2]"
    assert extract_answer("<answer>1</answer> <answer>2", require_close=False) == "1"  # a closed block wins
    assert extract_answer("no block", require_close=False) is None


def test_reasoning_answers_are_read_after_the_think_section_only():
    reply = "<think>maybe <answer>1</answer>? no, trace again</think>\n<answer>2</answer>"
    assert extract_answer(reply, reasoning=True) == "2"
    assert extract_answer("<think>still thinking <answer>1</answer>", reasoning=True) is None
    assert extract_answer("<think>x</think><answer>1", require_close=False, reasoning=True) == "1"
    assert extract_answer("<answer>2</answer>", reasoning=False) == "2"
    p = parse_proposal("code_o", "<think>plan: sort, then slice</think>\n" + PROPOSAL, reasoning=True)
    assert p.error is None and p.input == "[3, 1, 2], 2"
    assert parse_proposal("code_o", "<think>" + PROPOSAL, reasoning=True).error == \
        "malformed: no </think> closing the reasoning"
