"""Stop strings end a completion when its text contains them, not when any of their tokens comes up.

A byte-level BPE tokenizer, trained here, writes "Answer:" as three tokens (Ans, wer, :), and a tiny model,
trained here to say "x Ans: y Answer: 42" after its prompt (tests/parrot.py), shows one of those pieces
(":") early. The embedded engine must run past it, stop right after the token that completes the string,
and keep the tokens exactly as sampled. test_vllm.py checks vLLM on the same model.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tidal.core.interfaces import GenerationRequest
from tidal.core.protocol import SamplingParams
from tidal.rollout.engines.embedded import EmbeddedEngine, EngineError
from tidal.rollout.engines.stops import split_stops, stop_string_ended, stop_window
from tidal.rollout.tiny import build_char_tokenizer, load_tokenizer

sys.path.insert(0, str(Path(__file__).parent))
from parrot import PROMPT, TEXT, bpe_tokenizer, build_parrot

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def parrot(tmp_path_factory):
    return build_parrot(tmp_path_factory.mktemp("parrot") / "model")


def greedy(rid: str, tok, **kw) -> GenerationRequest:
    return GenerationRequest(request_id=rid, prompt_ids=tok.encode(PROMPT),
                             sampling=SamplingParams(temperature=0.0, max_tokens=16, **kw))


def test_split_stops_keeps_single_token_stops_as_ids_and_the_rest_as_strings():
    char = build_char_tokenizer()
    assert split_stops(char, ["\n", "Answer:", "\n"]) == ([char.encode("\n")[0]], ["Answer:"])
    bpe = bpe_tokenizer()
    assert len(bpe.encode("Answer:")) == 3
    ans = bpe.encode("Ans")
    assert len(ans) == 1
    assert split_stops(bpe, ["Ans", "Answer:", "\n"]) == ([ans[0], bpe.encode("\n")[0]], ["Answer:"])
    with pytest.raises(ValueError, match="empty stop string"):
        split_stops(bpe, [""])


def test_a_stop_string_matches_only_where_the_last_token_completes_it():
    bpe = bpe_tokenizer()
    ids = bpe.encode(TEXT)
    stops = ["Answer:"]
    w = stop_window(stops)
    ended = [i for i in range(1, len(ids) + 1)
             if stop_string_ended(bpe, ids[max(0, i - w) : i], stops)]
    assert bpe.decode(ids[: ended[0]]) == "x Ans: y Answer:"
    assert ended == [ended[0]]  # later tails still hold it, but it did not end in their last token


def test_the_engine_stops_on_the_string_not_on_its_pieces(parrot):
    tok = load_tokenizer(parrot)
    want = tok.encode(TEXT)
    answer_colon = len(tok.encode("x Ans: y Answer:"))  # tokens up to the one completing "Answer:"
    old_ids = [i for s in ["Answer:"] for i in tok.encode(s)]  # the old one-token-at-a-time expansion
    assert len(old_ids) == 3 and want.index(tok.encode(":")[0]) < answer_colon - 1
    ids, strings = split_stops(tok, ["Answer:", "\n"])
    assert strings == ["Answer:"] and ids == tok.encode("\n")
    with EmbeddedEngine(parrot, max_num_seqs=8, max_model_len=64) as eng:
        reqs = [
            greedy("plain", tok),
            greedy("string", tok, stop_token_ids=ids, stop=strings),
            greedy("old", tok, stop_token_ids=old_ids),
            greedy("inside", tok, stop=["Answer: 4"]),  # ends inside the token " 42"
            greedy("newline", tok, stop=["\n"]),  # a string stop that is also one token
        ]
        res = {r.request_id: r for r in eng.generate(reqs, timeout=120)}
    assert res["plain"].completion_ids == [*want, tok.eos_token_id], "the trained model should say TEXT"
    for r in res.values():
        assert r.finish_reason == "stop"
        assert len(r.logprobs) == len(r.versions) == len(r.completion_ids)
    assert res["string"].completion_ids == want[:answer_colon]
    assert tok.decode(res["string"].completion_ids) == "x Ans: y Answer:"
    # the old expansion stopped on the ":" of "Ans:", three tokens in
    assert tok.decode(res["old"].completion_ids) == "x Ans:"
    # the token that completes a stop string is kept whole: no cut inside it
    assert tok.decode(res["inside"].completion_ids) == "x Ans: y Answer: 42"
    assert res["newline"].completion_ids == want


def test_stop_strings_on_an_engine_without_a_tokenizer_are_refused(parrot):
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(parrot)
    with EmbeddedEngine(AutoModelForCausalLM.from_pretrained(parrot), max_num_seqs=2, max_model_len=64) as eng:
        with pytest.raises(EngineError, match="tokenizer"):
            eng.submit(greedy("s", tok, stop=["Answer:"]))
    with EmbeddedEngine(AutoModelForCausalLM.from_pretrained(parrot), max_num_seqs=2, max_model_len=64,
                        tokenizer=tok) as eng:
        (r,) = eng.generate([greedy("s", tok, stop=["Answer:"])], timeout=120)
    assert tok.decode(r.completion_ids) == "x Ans: y Answer:" and r.finish_reason == "stop"
