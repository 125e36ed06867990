"""Token-exact capture and segments (DESIGN section 4), on the real engine through Session."""

import asyncio
import copy

import pytest

from molt.endpoint.errors import ContextLengthExceeded, RequestError
from molt.endpoint.messages import ChatRequest, Sampling, normalize_messages
from molt.endpoint.session import Session
from molt.endpoint.template_check import TemplateError, turn_end_text


class RecordingEngine:
    """The real engine, plus a record of exactly what it returned for each request."""

    def __init__(self, engine):
        self.engine = engine
        self.sampled: list[list[int]] = []
        self.fail_next = False

    async def stream(self, token_ids, sampling, **kwargs):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected engine failure")
        ids = []
        async for delta in self.engine.stream(token_ids, sampling, **kwargs):
            ids += delta.token_ids
            yield delta
        self.sampled.append(ids)


def _session(engine, tokenizer=None, max_length=256, max_tokens=8) -> tuple[Session, RecordingEngine]:
    from molt.agents.base import SamplingParams

    recorder = RecordingEngine(engine.engine)
    tokenizer = tokenizer or engine.engine.tokenizer
    session = Session(session_id="s", api_key="k", model_name="m", engine=recorder, tokenizer=tokenizer,
                      sampling=SamplingParams(max_tokens=max_tokens), max_length=max_length,
                      base_url="http://127.0.0.1:1/s/s", turn_end=turn_end_text(tokenizer))
    return session, recorder


def _request(messages, tools=None, *, retry=False, **sampling) -> ChatRequest:
    return ChatRequest(messages=normalize_messages(messages), tools=tools, sampling=Sampling(**sampling), retry=retry)


def _ask(engine, session, messages, tools=None, **options):
    return engine.run(session.complete(_request(messages, tools, **options)))


def _action_runs(segment) -> list[list[int]]:
    runs, current = [], []
    for token, is_action in zip(segment.token_ids, segment.action_mask):
        if is_action:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def test_three_turns_are_one_segment_of_exactly_the_sampled_ids(engine):
    session, recorder = _session(engine)
    messages = [{"role": "user", "content": "3+5="}]
    for turn in range(3):
        reply = _ask(engine, session, messages)
        messages = messages + [{"role": "assistant", "content": reply.content},
                               {"role": "user", "content": f"and again {turn}"}]
    assert len(session.all_segments()) == 1
    (segment,) = session.all_segments()
    assert _action_runs(segment) == recorder.sampled
    assert len(segment.logprobs) == len(segment.token_ids) == len(segment.versions) == len(segment.action_mask)
    assert session.ledger.counts == {"first_turn": 1, "continued": 2}
    # Context between turns is what the template renders for the new messages.
    text = engine.engine.tokenizer.decode(segment.token_ids)
    assert "and again 0" in text and "and again 1" in text


def test_all_new_messages_after_the_reply_are_appended(engine):
    session, _ = _session(engine)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "3+5="}]
    reply = _ask(engine, session, messages, tools)
    messages += [{"role": "assistant", "content": reply.content},
                 {"role": "user", "content": "first note"}, {"role": "user", "content": "second note"}]
    _ask(engine, session, messages, tools)
    (segment,) = session.all_segments()
    context = engine.engine.tokenizer.decode([t for t, a in zip(segment.token_ids, segment.action_mask) if not a])
    assert "first note" in context and "second note" in context


def test_tool_results_in_a_row_are_all_context(engine):
    session, _ = _session(engine)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "3+5="}]
    reply = _ask(engine, session, messages, tools)
    # The agent's history as it would send it: the reply, then several tool results.
    messages += [{"role": "assistant", "content": reply.content},
                 {"role": "tool", "tool_call_id": "a", "content": "RESULT-ONE"},
                 {"role": "tool", "tool_call_id": "b", "content": "RESULT-TWO"}]
    _ask(engine, session, messages, tools)
    assert session.ledger.counts["continued"] == 1
    (segment,) = session.all_segments()
    context = engine.engine.tokenizer.decode([t for t, a in zip(segment.token_ids, segment.action_mask) if not a])
    assert "RESULT-ONE" in context and "RESULT-TWO" in context


def test_compaction_opens_a_second_segment(engine):
    session, recorder = _session(engine)
    messages = [{"role": "user", "content": "3+5="}]
    _ask(engine, session, messages)
    compacted = [{"role": "user", "content": "summary of earlier work; 3+5="}]  # history rewritten
    _ask(engine, session, compacted)
    segments = session.all_segments()
    assert len(segments) == 2
    assert [_action_runs(s) for s in segments] == [[recorder.sampled[0]], [recorder.sampled[1]]]
    assert session.ledger.counts["history_rewrite"] == 1


def test_a_template_that_rewrites_history_forces_a_new_segment(engine):
    tokenizer = copy.deepcopy(engine.engine.tokenizer)
    # Like templates that drop earlier reasoning: earlier assistant turns render empty.
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}"
        "<|im_start|>assistant\n<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    session, _ = _session(engine, tokenizer=tokenizer)
    messages = [{"role": "user", "content": "3+5="}]
    reply = _ask(engine, session, messages)
    if not reply.content.strip():
        pytest.skip("the sampled reply was empty, so the rewrite is invisible")
    _ask(engine, session, messages + [{"role": "assistant", "content": reply.content},
                                      {"role": "user", "content": "again"}])
    assert session.ledger.counts["template_rewrite"] == 1
    assert len(session.all_segments()) == 2


def test_only_a_retry_the_client_marks_returns_the_cached_reply(engine):
    session, recorder = _session(engine)
    messages = [{"role": "user", "content": "3+5="}]
    first = _ask(engine, session, messages)
    tokens = list(session.current.token_ids)
    again = _ask(engine, session, messages, retry=True)  # x-stainless-retry-count > 0
    assert again == first and session.current.token_ids == tokens and len(recorder.sampled) == 1
    assert session.ledger.counts["retry"] == 1
    # The same request unmarked is a new sample (an agent drawing candidates): a new segment.
    _ask(engine, session, messages)
    assert len(recorder.sampled) == 2 and len(session.all_segments()) == 2
    assert session.ledger.counts["history_rewrite"] == 1


def test_overlapping_requests_each_land_in_exactly_one_segment(engine):
    """Two calls at once in one session are served one after the other; the second does not extend
    the first's reply, so it opens its own segment, and both replies are recorded."""
    session, recorder = _session(engine)

    async def both():
        return await asyncio.gather(session.complete(_request([{"role": "user", "content": "3+5="}])),
                                    session.complete(_request([{"role": "user", "content": "2+2="}])))

    engine.run(both())
    segments = session.all_segments()
    assert [_action_runs(s) for s in segments] == [[recorder.sampled[0]], [recorder.sampled[1]]]
    assert session.ledger.counts == {"first_turn": 1, "history_rewrite": 1}


def test_each_token_records_the_temperature_it_was_sampled_at(engine):
    session, _ = _session(engine)
    messages = [{"role": "user", "content": "3+5="}]
    reply = _ask(engine, session, messages, temperature=0.7)
    _ask(engine, session, messages + [{"role": "assistant", "content": reply.content},
                                      {"role": "user", "content": "again"}])
    (segment,) = session.all_segments()
    runs = _action_runs(segment)
    temperatures = [t for t, is_action in zip(segment.temperatures, segment.action_mask) if is_action]
    assert temperatures == [0.7] * len(runs[0]) + [1.0] * len(runs[1])
    assert segment.action_temperatures_or_none(1.0) == segment.temperatures
    assert segment.action_temperatures_or_none(0.7) == segment.temperatures


def test_a_template_that_leaves_the_final_turn_open_is_refused(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert turn_end_text(tokenizer) == "<|im_end|>\n"
    # Closes assistant turns only when more messages follow: the end-of-turn would be taken from
    # the previous turn and the reply recorded twice.
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% if not (loop.last and m.role == 'assistant') %}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(TemplateError, match="unclosed"):
        turn_end_text(tokenizer)


def test_a_failed_generation_records_nothing(engine):
    session, recorder = _session(engine)
    messages = [{"role": "user", "content": "3+5="}]
    reply = _ask(engine, session, messages)
    before = [list(s.token_ids) for s in session.all_segments()]
    recorder.fail_next = True
    follow_up = messages + [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "x"}]
    with pytest.raises(RuntimeError, match="injected"):
        _ask(engine, session, follow_up)
    assert [list(s.token_ids) for s in session.all_segments()] == before
    _ask(engine, session, follow_up)  # the session is still usable and continues the segment
    assert session.ledger.counts["continued"] == 1


def test_context_overflow_is_a_400_and_records_nothing(engine):
    session, _ = _session(engine, max_length=16)
    with pytest.raises(ContextLengthExceeded) as error:
        _ask(engine, session, [{"role": "user", "content": "a long question " * 10}])
    assert error.value.status == 400 and error.value.code == "context_length_exceeded"
    assert session.all_segments() == [] and session.context_exhausted


def test_a_reply_cut_at_max_tokens_has_a_logprob_per_token_and_continues_cleanly(engine):
    session, recorder = _session(engine, max_tokens=2)
    tokenizer = engine.engine.tokenizer
    messages = [{"role": "user", "content": "3+5="}]
    reply = _ask(engine, session, messages, temperature=1.0)
    segment = session.current
    if reply.finish_reason != "length":
        pytest.skip("the reply ended before max_tokens")
    assert segment.truncated and sum(segment.action_mask) == 2 == len(recorder.sampled[0])
    messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "more"}]
    _ask(engine, session, messages)
    (segment,) = session.all_segments()
    first_context_after = segment.action_mask.index(0, segment.action_mask.index(1))
    assert segment.token_ids[first_context_after] == tokenizer.eos_token_id  # the end-of-turn it never sampled


@pytest.mark.parametrize("messages, expected", [
    ([], "non-empty list"),
    ([{"role": "wizard", "content": "x"}], "role='wizard'"),
    ([{"role": "user", "content": 5}], "must be a string or a list"),
    (["hello"], "must be an object"),
])
def test_bad_messages_are_refused(engine, messages, expected):
    session, _ = _session(engine)
    with pytest.raises(RequestError, match=expected):
        _ask(engine, session, messages)


def test_the_template_check_passes_the_tiny_template_and_flags_a_rewriting_one(tiny_model_dir):
    from transformers import AutoTokenizer

    from molt.endpoint.template_check import find_prefix_breaks

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert find_prefix_breaks(tokenizer) == []
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}"
        "<|im_start|>assistant\n<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    problems = find_prefix_breaks(tokenizer)
    assert len(problems) == 3 and "message 2" in problems[0]
