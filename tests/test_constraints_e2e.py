"""Constrained replies on the real vLLM engine, checked against a Hugging Face recomputation.

Under a constraint the engine samples from the policy's distribution masked by the grammar, so
each behaviour log-prob must equal the model's own log-prob renormalized over the tokens the
grammar allowed at that step (xgrammar's mask, recomputed here on the same tokenizer). On the
warm-started tool model, which wants to call the calculator on a first turn, the forced call must
also come out in the tokenizer's own tokenization of its text (molt.endpoint.constraints)."""

import pytest

pytestmark = pytest.mark.e2e

TOLERANCE = 1e-3  # nats: fp32 engine vs fp32 transformers on a 2-layer model


@pytest.fixture(scope="module")
def tool_engine(tiny_tool_model_dir):
    from conftest import EngineThread

    thread = EngineThread(tiny_tool_model_dir)
    yield thread
    thread.close()


def masked_logprobs(model_dir, prompt: list[int], sampled: list[int], constraint: dict) -> list[float]:
    """The model's log-prob of each sampled token, renormalized over what the grammar allowed."""
    import torch
    import xgrammar
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab_size = model.config.vocab_size
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size))
    matcher = xgrammar.GrammarMatcher(compiler.compile_structural_tag(constraint["structural_tag"]))
    with torch.no_grad():
        logits = model(torch.tensor([prompt + sampled])).logits[0, len(prompt) - 1:-1]
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    result = []
    for step, token in enumerate(sampled):
        matcher.fill_next_token_bitmask(bitmask)
        masked = logits[step].clone()[None]
        xgrammar.apply_token_bitmask_inplace(masked, bitmask)
        result.append(torch.log_softmax(masked[0].double(), -1)[token].item())
        assert matcher.accept_token(token), f"the engine sampled token {token} that the grammar forbids"
    return result


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "calculator"}}])
def test_forced_call_is_canonical_and_logprobs_are_the_masked_models(tool_engine, tiny_tool_model_dir, tool_choice):
    from fixtures_models import FRAMEWORK_TOOLS

    from molt.agents.base import SamplingParams
    from molt.endpoint.constraints import build_constraint
    from molt.endpoint.openai_chat import parse_chat_request
    from molt.endpoint.tool_calls import ToolCallParser

    # The demo declaration keeps the prompt within the shared engine's 256 tokens; a second tool
    # makes 'required' a real choice.
    tools = FRAMEWORK_TOOLS["demo"] + [{"type": "function", "function": {"name": "noop", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}]
    tokenizer = tool_engine.engine.tokenizer
    for seed, question in enumerate(["3+4=", "8+1=", "0+6="]):
        chat = parse_chat_request({"messages": [{"role": "user", "content": question}], "tools": tools,
                                   "tool_choice": tool_choice})
        constraint = build_constraint(chat)
        prompt = tokenizer.apply_chat_template(chat.messages, tools=tools, add_generation_prompt=True,
                                               tokenize=True, return_dict=False)

        async def generate():
            return [delta async for delta in tool_engine.engine.stream(
                prompt, SamplingParams(max_tokens=48, temperature=1.0), seed=seed, incremental=False,
                constraint=constraint)][-1]

        reply = tool_engine.run(generate())
        sampled = list(reply.token_ids)
        parser = ToolCallParser()
        parts = parser.feed(reply.text) + parser.finish()
        assert [(part.name, part.arguments) for part in parts] == [("calculator", "{}")], reply.text
        body = [token for token in sampled if token != tokenizer.eos_token_id]
        assert body == tokenizer.encode(reply.text, add_special_tokens=False), (
            tokenizer.convert_ids_to_tokens(body))
        expected = masked_logprobs(tiny_tool_model_dir, prompt, sampled, constraint)
        gaps = [abs(behaviour - own) for behaviour, own in zip(reply.logprobs, expected)]
        assert max(gaps) < TOLERANCE, list(zip(tokenizer.convert_ids_to_tokens(sampled), reply.logprobs, expected))
