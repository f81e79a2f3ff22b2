"""Log-probabilities computed on the last stage, through the official ``openai`` client on a real
cluster (the session's ``served3``: 3 stateful stages, exact): every generated token comes with
the whole model's log-probability of it (its logits' log-softmax, as the whole model in one
process computes them) and its most likely alternatives, most likely first, in a chat
completion's shape and in a legacy completion's, whole and streamed, greedy and sampled. Bad
values are refused by name. And a paged last stage (in process) answers a micro-batch's parts
with theirs, a verify's at every position."""

from __future__ import annotations

import itertools
import json
import urllib.request
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import pytest

from agent.protocol import BatchIds, Part, SamplingSpec, TokenLogprobs, decode
from agent.protocol.batch import Batch
from coordinator.api.logprobs import token_text
from tests.support.figures import report
from tests.support.served import Served

MODEL = "smollm2-135m"
QUESTION = [{"role": "user", "content": "Name three colours, then say in one sentence why the sky is blue."}]
N = 16
CLOSE = 1e-4  # a served log-probability against the whole model's


def _client(served: Served) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{served.api_url}/v1", api_key="unused", max_retries=0, timeout=300)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64).reshape(-1)
    m = z.max()
    out: np.ndarray = z - m - float(np.log(np.exp(z - m).sum()))
    return out


def _teacher(chain: Any, prompt: Sequence[int], toks: Sequence[int]) -> list[np.ndarray]:
    """The whole model's log-probabilities before each of ``toks`` and after the last, the
    prompt then one token a step (as decoding computes them)."""
    streams = chain.open_streams()
    for st in streams:
        st.reset()
    out = chain.forward(streams, np.asarray(prompt, dtype=np.int64)[None, :])
    rows = [_log_softmax(out.logits[-1])]
    for t in toks:
        out = chain.forward(streams, np.array([[t]], dtype=np.int64))
        rows.append(_log_softmax(out.logits[-1]))
    return rows


def _streamed(chunks: list[Any]) -> list[Any]:
    """A streamed chat answer's tokens' log-probabilities, chunk after chunk."""
    return [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content or []]


def _head_steps(node: str) -> int:
    with urllib.request.urlopen(f"http://{node}/v1/node", timeout=10) as r:
        return int(json.loads(r.read())["stage"]["head_steps"])


def _check_alternatives(
    tok: Any, alts: list[tuple[bytes, float]], ref: np.ndarray, n: int, close: float = CLOSE
) -> None:
    """``alts`` (bytes, log-probability) are ``n`` of the reference's most likely, most likely first,
    each with the reference's figure (alike figures may come in either order)."""
    assert len(alts) == n
    values = [v for _, v in alts]
    assert values == sorted(values, reverse=True)
    best = np.argsort(-ref, kind="stable")
    by_bytes = {tok.token_bytes(int(i)): float(ref[i]) for i in best[: n + 8]}
    for b, v in alts:
        assert b in by_bytes and abs(v - by_bytes[b]) < close
    assert values[-1] >= ref[best[n - 1]] - close  # none likelier left out


# -- chat completions --------------------------------------------------------------------------------


def test_a_greedy_chats_tokens_come_with_the_whole_models_logprobs_whole_and_streamed(  # type: ignore[no-untyped-def]
    served3: Served, whole_int8, smollm2_tokenizer
) -> None:
    tok = smollm2_tokenizer
    client = _client(served3)
    ids = tok.chat_ids(QUESTION)
    ref = whole_int8.generate(ids, max_tokens=N, stop_ids=tok.stop_ids, keep_logits=True)
    kw: dict[str, Any] = {"model": MODEL, "messages": QUESTION, "max_tokens": N, "temperature": 0}
    split = _head_steps(served3.nodes[-1])
    got = client.chat.completions.create(**kw, logprobs=True, top_logprobs=5)
    assert _head_steps(served3.nodes[-1]) == split  # they need the whole head: no step split it
    choice = got.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert got.usage is not None and len(content) == got.usage.completion_tokens == len(ref.tokens)
    assert [bytes(c.bytes or []) for c in content] == [tok.token_bytes(t) for t in ref.tokens]
    assert b"".join(bytes(c.bytes or []) for c in content).decode() == choice.message.content
    worst = 0.0
    for c, t, logits in zip(content, ref.tokens, ref.logits, strict=False):
        lsm = _log_softmax(logits)
        worst = max(worst, abs(c.logprob - lsm[t]))
        assert abs(c.logprob - lsm[t]) < CLOSE
        assert c.token == token_text(tok.token_bytes(t))
        # greedy: the chosen token is the likeliest, first among its alternatives
        assert (c.top_logprobs[0].token, c.top_logprobs[0].logprob) == (c.token, c.logprob)
        _check_alternatives(tok, [(bytes(a.bytes or []), a.logprob) for a in c.top_logprobs], lsm, 5)
    report(f"logprobs: served3 greedy chat against the whole model: worst |diff| {worst:.1e}, {len(content)} tokens")
    # the same, streamed: each chunk carries its tokens'
    chunks = list(client.chat.completions.create(**kw, logprobs=True, top_logprobs=5, stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    streamed = _streamed(chunks)
    assert text == choice.message.content
    assert [(c.token, c.bytes) for c in streamed] == [(c.token, c.bytes) for c in content]
    assert np.allclose([c.logprob for c in streamed], [c.logprob for c in content], atol=1e-6)
    for s, w in zip(streamed, content, strict=True):
        assert [a.token for a in s.top_logprobs] == [a.token for a in w.top_logprobs]
    # logprobs without alternatives; and none where not asked
    bare = client.chat.completions.create(**kw, logprobs=True).choices[0].logprobs
    assert bare is not None and bare.content is not None
    assert [c.top_logprobs for c in bare.content] == [[]] * len(content)
    assert np.allclose([c.logprob for c in bare.content], [c.logprob for c in content], atol=1e-6)
    assert client.chat.completions.create(**kw).choices[0].logprobs is None


def test_a_sampled_chats_tokens_come_with_the_models_own_logprobs(  # type: ignore[no-untyped-def]
    served3: Served, whole_int8, smollm2_tokenizer
) -> None:
    """Sampled at temperature 0.9, top-p 0.95: each token's figure is still the model's own
    distribution (temperature 1, no cut), as OpenAI reports it. The token ids come from the
    chunks an agent's gateway asks for (``X-Lakeshard-Resume``)."""
    tok = smollm2_tokenizer
    chunks = list(
        _client(served3).chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            max_tokens=N,
            temperature=0.9,
            top_p=0.95,
            seed=11,
            logprobs=True,
            top_logprobs=3,
            stream=True,
            extra_headers={"X-Lakeshard-Resume": "1"},
        )
    )
    told = [cast(dict[str, Any], ch.model_extra or {}).get("lakeshard") or {} for ch in chunks]
    ids = [i for lk in told for i in lk.get("ids", [])]
    content = _streamed(chunks)
    assert len(ids) == len(content) > 4
    assert [bytes(c.bytes or []) for c in content] == [tok.token_bytes(t) for t in ids]
    rows = _teacher(whole_int8, tok.chat_ids(QUESTION), ids)
    for c, t, lsm in zip(content, ids, rows, strict=False):
        assert abs(c.logprob - lsm[t]) < CLOSE
        _check_alternatives(tok, [(bytes(a.bytes or []), a.logprob) for a in c.top_logprobs], lsm, 3)
        assert c.logprob <= c.top_logprobs[0].logprob + CLOSE


# -- the legacy completions --------------------------------------------------------------------------


def test_a_legacy_completions_logprobs_whole_and_streamed(served3: Served, whole_int8, smollm2_tokenizer) -> None:  # type: ignore[no-untyped-def]
    tok = smollm2_tokenizer
    client = _client(served3)
    prompt = "The three primary colours are"
    ref = whole_int8.generate(tok.text_ids(prompt), max_tokens=10, stop_ids=tok.stop_ids, keep_logits=True)
    kw: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0, "logprobs": 3}
    choice = client.completions.create(**kw).choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert lp.tokens == [token_text(tok.token_bytes(t)) for t in ref.tokens]
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == list(itertools.accumulate([0, *(len(t) for t in lp.tokens[:-1])]))
    each = zip(ref.tokens, lp.tokens, lp.token_logprobs, lp.top_logprobs, ref.logits, strict=False)
    for t, text, v, top, logits in each:
        lsm = _log_softmax(logits)
        assert abs(v - lsm[t]) < CLOSE
        assert 1 <= len(top) <= 4 and top[text] == v == max(top.values())  # the chosen, the likeliest, among them
    chunks = list(client.completions.create(**kw, stream=True))
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens or []] == lp.tokens
    assert [o for p in parts for o in p.text_offset or []] == lp.text_offset
    assert np.allclose([v for p in parts for v in p.token_logprobs or []], lp.token_logprobs, atol=1e-6)
    assert client.completions.create(**{**kw, "logprobs": None}).choices[0].logprobs is None


@pytest.mark.parametrize(
    ("kind", "kw", "param"),
    [
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true
        ("chat", {"logprobs": "yes"}, "logprobs"),
        ("text", {"logprobs": 21}, "logprobs"),
        ("text", {"logprobs": True}, "logprobs"),
    ],
)
def test_bad_logprobs_are_refused_by_name(served3: Served, kind: str, kw: dict[str, Any], param: str) -> None:
    import openai

    client = _client(served3)
    with pytest.raises(openai.BadRequestError) as e:
        if kind == "chat":
            client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, extra_body=kw)
        else:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body=kw)
    assert e.value.param == param and param in e.value.message


# -- a paged last stage -----------------------------------------------------------------------------


def test_a_paged_last_stage_answers_each_parts_logprobs(whole_int8, smollm2_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The whole model paged, in process: one micro-batch of three prompts (two asking, one
    sampled, one not asking), then a verify of a token and two drafts: every token the stage
    chose has the whole model's log-probability at its position, through the frame codec."""
    from agent.runtime.paged import PagedStage
    from agent.serving.paged_worker import PagedWorker

    tok = smollm2_tokenizer
    stage = PagedStage(whole_int8.stages[0].dir, device="CPU", threads=1, exact=True, num_blocks=64)
    worker = PagedWorker(stage, max_streams=4)
    a, b = tok.chat_ids(QUESTION), tok.chat_ids([{"role": "user", "content": "Hi"}])
    asks, sampled = SamplingSpec(logprobs=4), SamplingSpec(0.9, 1.0, 3, logprobs=0)

    def step(seq: int, parts: list[Part], ids: list[int]) -> BatchIds:
        msg = Batch(term=1, seq=seq, dtype="i32", parts=tuple(parts))
        out = worker.batch(msg, memoryview(np.asarray(ids, dtype=np.int32).tobytes()), range(len(parts)), "f32")
        assert out.frame is not None and not out.failed
        got = decode(out.frame)[0]
        assert isinstance(got, BatchIds)
        return got

    first = step(
        0,
        [
            Part("a", 0, len(a), start=True, logits=1, sampling=asks),
            Part("b", 0, len(b), start=True, logits=1, sampling=sampled),
            Part("c", 0, len(b), start=True, logits=1),
        ],
        a + b + b,
    )
    toks, lps = first.tokens_of(), first.logprobs_of()
    assert set(lps) == {"a", "b"}
    ta = toks["a"][0]
    drafts = [ta, 13, 42]  # a verify: its token and two drafts, a token at each position
    second = step(1, [Part("a", 1, 3, logits=3, sampling=asks)], drafts)
    rows_a = _teacher(whole_int8, a, drafts)
    got: list[tuple[int, TokenLogprobs, np.ndarray]] = [(ta, lps["a"][0], rows_a[0])]
    got += list(zip(second.tokens_of()["a"], second.logprobs_of()["a"], rows_a[1:], strict=True))
    got.append((toks["b"][0], lps["b"][0], _teacher(whole_int8, b, [])[0]))
    for t, lp, ref in got:
        assert abs(lp.logprob - ref[t]) < 1e-3
    for t, lp, ref in got[:-1]:  # greedy, 4 alternatives: the likeliest first, the chosen among them
        assert lp.top[0] == (t, lp.logprob)
        _check_alternatives(tok, [(tok.token_bytes(i), v) for i, v in lp.top], ref, 4, close=1e-3)
    assert got[-1][1].top == ()
    worker.close_all()
    assert stage.free_blocks == 64
