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


def test_the_stage_fits_reference_answers_or_records_and_tidal_sft_prints_the_next_command(tmp_path, capsys):
    from pathlib import Path

    from tidal.integration.cli import main
    from tidal.integration.recipe import load_recipe
    from tidal.integration.sft_stage import sft_stage
    from tidal.rollout.tiny import build_tiny_model

    recipe = Path(__file__).parent / "recipes" / "tiny.toml"
    model = build_tiny_model(tmp_path / "m", hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, seed=0)
    cfg = load_recipe(recipe, [f'model="{model}"', "eval.size=8", "sampling.max_tokens=3"])
    lines: list[str] = []
    r = sft_stage(cfg, tmp_path / "out", steps=3, batch=4, say=lines.append)
    assert (r.out / "config.json").is_file() and r.accuracy_before is not None and r.accuracy_after is not None
    assert any("SFT step 3/3" in line for line in lines) and any("reference answers of arithmetic" in line for line in lines)
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "completion": "2"}\n')
    r2 = sft_stage(cfg, tmp_path / "out2", steps=2, batch=2, data=data, measure=False, say=lines.append)
    assert (r2.out / "config.json").is_file() and r2.accuracy_before is None
    code = main(["sft", str(recipe), f'model="{model}"', "eval.size=8", "--steps", "2", "--batch", "2",
                 "--out", str(tmp_path / "out3")])
    out = capsys.readouterr().out
    assert code == 0 and f'model="{tmp_path / "out3"}"' in out.splitlines()[-1], out
