"""`tidal sft --data FILE.jsonl`: what a record may be, and the errors that name a bad one."""

from __future__ import annotations

import pytest

from tidal.core.errors import ConfigError
from tidal.integration.sft_stage import Records, read_records
from tidal.rollout.tiny import build_char_tokenizer


def test_prompt_completion_records_are_read_and_cycled_shuffled(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "1+1=", "completion": "2"}\n\n{"prompt": "2+2=", "completion": "4"}\n')
    records = read_records(f, build_char_tokenizer())
    assert [(r.prompt, r.completion) for r in records] == [("1+1=", "2"), ("2+2=", "4")]
    first = Records(records).tasks("train", 0)
    assert sorted(next(first).prompt for _ in range(4)) == ["1+1=", "1+1=", "2+2=", "2+2="]


@pytest.mark.parametrize(("line", "needle"), [
    ("not json", "line 1: not JSON"),
    ('{"prompt": "x"}', 'a record is {"prompt": str, "completion": str}'),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "the last message must be the assistant's"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}', "chat template"),
])
def test_a_bad_record_is_refused_naming_its_line_and_what_a_record_holds(tmp_path, line, needle):
    f = tmp_path / "d.jsonl"
    f.write_text(line + "\n")
    with pytest.raises(ConfigError, match="--data") as e:
        read_records(f, build_char_tokenizer())  # the demo's character tokenizer has no chat template
    assert needle in str(e.value)


def test_an_empty_or_missing_file_is_refused(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="holds no record"):
        read_records(tmp_path / "e.jsonl", build_char_tokenizer())
    with pytest.raises(ConfigError, match="nowhere.jsonl"):
        read_records(tmp_path / "nowhere.jsonl", build_char_tokenizer())
